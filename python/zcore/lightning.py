"""PyTorch Lightning's Trainer, training on a zcore engine.

    import lightning as L
    import zcore.lightning  # registers "zcore", "zcore_stage_1" ... "zcore_stage_3_offload"

    trainer = L.Trainer(strategy="zcore_stage_3", accelerator="cpu", devices=2,
                        accumulate_grad_batches=2, gradient_clip_val=1.0, precision="bf16-mixed")
    trainer.fit(module)                      # or trainer.fit(module, ckpt_path=...)

or ``strategy=ZcoreStrategy(config={...})`` with a zcore (DeepSpeed-style)
config, a dict or a JSON file. The names are registered in Lightning's
``StrategyRegistry`` when this module is imported (``import zcore`` alone
never imports Lightning); Lightning 2.6 discovers third-party strategies
through no entry point, only callbacks. This is ``lightning.pytorch``, the
``lightning`` package; the older ``pytorch_lightning`` package has its own
classes and does not take this strategy.

Lightning keeps its loop, data, logging, callbacks, LR schedulers and
checkpoint naming; zcore owns the parameters, gradients, optimizer step and
precision. From the Trainer and the LightningModule, unless the config says
the same (it may repeat them, not differ):
- the optimizer from ``configure_optimizers`` (a torch optimizer over the
  module's parameters, re-pointed at zcore's master shards, so the LR
  schedulers built on it keep working and step as Lightning steps them), or
  the config's ``optimizer`` section (with its ``scheduler``, handed to
  Lightning to step after every optimizer step) where
  ``configure_optimizers`` returns None;
- ``gradient_accumulation_steps`` from ``accumulate_grad_batches``; Lightning
  decides each accumulation's end (an epoch's last may be shorter) and has
  divided the loss already;
- ``gradient_clipping`` from ``gradient_clip_val`` (by norm: zcore clips the
  global norm of the sharded gradients in its step);
- ``bf16`` from ``precision="bf16-mixed"``, ``fp16`` (zcore's dynamic loss
  scaling, its settings from the config's ``fp16`` section) from
  ``"16-mixed"``; zcore keeps fp32 master weights and computes in that dtype
  (not autocast). On a CPU, Lightning itself turns "16-mixed" into
  "bf16-mixed" before a strategy sees it: pass
  ``plugins=[ZcorePrecision("16-mixed")]`` for fp16 there;
- ``train_micro_batch_size_per_gpu`` from the training loader's batch size,
  as Lightning's DeepSpeed strategy takes it (it only counts samples).

At ZeRO stage 3, ``configure_model()`` runs under the meta device, and
``zcore.initialize`` materialises the model straight into shards
(``zcore.MetaInit``; pass ``meta_init=`` for the model's own init): a model
larger than one rank's memory is never built whole. ``configure_model``
runs before every fit, validate, test and predict: build the model only
when it is not built yet.

A checkpoint (``trainer.save_checkpoint(path)``, ``ModelCheckpoint``) is a
directory at ``path`` holding zcore's sharded checkpoint (tag ``zcore``)
with Lightning's own state (loops, callbacks, LR schedulers) as its
client state; ``ckpt_path=`` resumes from it at any world size (the
weights, optimizer states and counters load at any world size; Lightning's
data order follows the new one), and ``zcore consolidate PATH OUT`` writes
the module's plain state dict. Evaluation after a fit runs on the same
engine; ``validate``/``test``/``predict`` before any fit build an engine
without an optimizer (ZeRO-Inference).

Refused, with the reason, rather than ignored: precisions other than
"32-true", "bf16-mixed" and "16-mixed"; clipping by value; an overridden
``configure_gradient_clipping`` or ``backward``; manual optimization;
``sync_batchnorm``; a ``CheckpointIO`` plugin or ``storage_options``;
weights-only checkpoints; a ``training_step`` that returns None; an
optimizer both in the config and from ``configure_optimizers``; a config
that disagrees with the Trainer; a second fit of a module zcore already
wraps; a rank whose device Lightning and zcore see differently. The Lightning version is
pinned (2.6.6) in the tests, as some of what this overrides is Lightning's
private API; another version is warned about once.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional, Union

import lightning
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.core.optimizer import (
    _init_optimizers_and_lr_schedulers,
    _MockOptimizer,
)
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.types import LRSchedulerConfig
from lightning_utilities import apply_to_collection
from torch.optim import Optimizer

from zcore.comm.collectives import init_distributed
from zcore.config.files import config_dict
from zcore.config.schema import Config, load_config
from zcore.engine.engine import Engine
from zcore.engine.initialize import initialize
from zcore.errors import CheckpointError, ConfigError, InvalidStateError
from zcore.zero3.meta_init import MetaInit

__all__ = ["ZcorePrecision", "ZcoreStrategy"]

CHECKPOINT_TAG = "zcore"
# Lightning's private API used here (its optimizer set-up, the precision plugin's
# _after_closure, the fit loop's data source, the connector's plugin rules) may change.
TESTED_LIGHTNING = "2.6.6"
_COMPUTE_DTYPES = {"32-true": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
_PRECISION_SECTIONS = {"bf16-mixed": "bf16", "16-mixed": "fp16"}
log = logging.getLogger("zcore")


class ZcorePrecision(Precision):
    """Lightning's precision as zcore's: "32-true", "bf16-mixed" or
    "16-mixed" select the zcore config's ``bf16`` or ``fp16`` (fp32 master
    weights, compute in the half dtype, no autocast). The backward and the
    optimizer step run in the engine that ``ZcoreStrategy`` gives it."""

    def __init__(self, precision: str = "32-true") -> None:
        if precision not in _COMPUTE_DTYPES:
            raise ConfigError(
                f"ZcorePrecision({precision!r}): zcore trains in one of {sorted(_COMPUTE_DTYPES)} (fp32 "
                "master weights, computing in fp32, bf16 or fp16)"
            )
        self.precision = precision
        self.engine: Optional[Engine] = None  # ZcoreStrategy.setup's

    def convert_input(self, data: Any) -> Any:
        """Floating-point inputs in the dtype zcore computes in (its weights
        are in that dtype, with no autocast to mix them)."""
        dtype = _COMPUTE_DTYPES[self.precision]
        if dtype is None:
            return data
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=torch.Tensor, dst_type=dtype)

    def backward(  # type: ignore[override]
        self, tensor: torch.Tensor, model: LightningModule, optimizer: Any, *args: Any, **kwargs: Any
    ) -> None:
        """zcore's backward (loss scale, gradients reduced as they come);
        Lightning divided the loss for accumulation already. A micro-batch
        that does not end the accumulation is counted here: Lightning steps
        only the last (``optimizer_step``)."""
        engine = self._engine()
        engine.backward(tensor, scale_wrt_gas=False)
        if not engine.is_gradient_accumulation_boundary():
            engine.step()

    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        """The accumulation's last micro-batch (the closure runs its forward
        and backward), then zcore's step, which clips and updates."""
        engine = self._engine()
        engine.set_gradient_accumulation_boundary(True)
        try:
            loss = closure()
            self._after_closure(model, optimizer)  # on_before_optimizer_step; clip_gradients is zcore's
            if loss is None:
                raise ConfigError(
                    "training_step returned None, which asks Lightning to skip the step; zcore cannot "
                    "skip one rank's step (the ranks reduce gradients together): return a loss"
                )
            engine.step()
        finally:
            engine.set_gradient_accumulation_boundary(False)
        return loss

    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: Union[int, float] = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """zcore clips in its step (``gradient_clipping``, from the Trainer's ``gradient_clip_val``)."""

    def _engine(self) -> Engine:
        if self.engine is None:
            raise InvalidStateError(
                "ZcorePrecision steps a zcore engine, which ZcoreStrategy gives it when the Trainer sets "
                "up; use it with strategy=ZcoreStrategy(...) (or one of the 'zcore' strategy names)"
            )
        return self.engine


class ZcoreStrategy(DDPStrategy):
    """Lightning's strategy for zcore: the process group and data sharding
    of Lightning's DDP strategy, with the module wrapped by ``zcore.initialize``
    instead of DistributedDataParallel (the module docstring says what comes
    from the Trainer and what is refused)."""

    def __init__(
        self,
        config: Union[dict, str, os.PathLike, None] = None,
        stage: Optional[int] = None,
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        meta_init: Optional[MetaInit] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: str = "popen",
    ) -> None:
        """``config``: zcore's (DeepSpeed-style) config, a dict or a JSON
        file; ``stage``, ``offload_optimizer`` and ``offload_parameters``
        (to host memory) set its ``zero_optimization`` (as the registered
        names do); ``meta_init``: how a model ``configure_model`` built on
        the meta device is materialised (stage 3; default
        ``zcore.MetaInit()``). The rest is Lightning's DDP strategy's."""
        _warn_if_untested(lightning.__version__)
        super().__init__(process_group_backend=process_group_backend, timeout=timeout, start_method=start_method)
        self._config = _with_zero_settings(config_dict(config), stage, offload_optimizer, offload_parameters)
        self._stage = load_config(self._config).zero_optimization.stage  # validated now, not at fit
        self._meta_init = meta_init
        self.engine: Optional[Engine] = None  # built at setup; kept for the evaluations after a fit

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register("zcore", cls, description="zcore, the ZeRO stage from its config (default 0)")
        for stage in (1, 2, 3):
            strategy_registry.register(
                f"zcore_stage_{stage}", cls, description=f"zcore ZeRO stage {stage}", stage=stage
            )
        strategy_registry.register(
            "zcore_stage_3_offload", cls, description="zcore ZeRO stage 3, parameters and optimizer in host memory",
            stage=3, offload_optimizer=True, offload_parameters=True,
        )

    # What the Trainer hands the strategy: refused where zcore would not use it.
    @property
    def precision_plugin(self) -> ZcorePrecision:
        # None until the Trainer sets it: the Trainer takes a strategy's own plugin over precision=.
        return self._precision_plugin if self._precision_plugin is not None else ZcorePrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        self._precision_plugin = None if plugin is None else _zcore_precision(plugin)

    @property
    def checkpoint_io(self) -> CheckpointIO:
        return DDPStrategy.checkpoint_io.fget(self)

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO) -> None:
        """Set by the Trainer only for a CheckpointIO plugin."""
        raise ConfigError(
            f"a CheckpointIO plugin ({type(io).__name__}) would never be used: zcore writes and reads "
            "its sharded checkpoints itself, every rank its own shards; remove the plugin"
        )

    # Construction and set-up.
    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Stage 3: ``configure_model`` builds on the meta device, and zcore
        materialises the model straight into shards."""
        if self._stage != 3:
            yield
            return
        with torch.device("meta"):
            yield

    def model_to_device(self) -> None:
        """zcore places each shard itself; moving the whole module to the
        device first is what ZeRO exists to avoid."""

    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        ours = self.engine if self.engine is not None and self.engine.module is module else None
        if trainer.state.fn == TrainerFn.FITTING:
            if ours is not None:
                raise ConfigError(
                    "this LightningModule is wrapped by a zcore engine already (an earlier fit, validate, "
                    "test or predict with this Trainer), and its parameters are zcore's: a fit cannot wrap "
                    "it again; fit before evaluating, or start from a new module (ckpt_path= resumes)"
                )
            self._check_device()
            self.engine = self._training_engine(trainer, module)
        elif ours is None:
            self._check_device()
            self.engine = initialize(model=module, config=_evaluation_config(self._config_with_precision()),
                                     meta_init=self._meta_init)[0]
        self.model = self.engine
        self.precision_plugin.engine = self.engine
        self.setup_precision_plugin()

    def _check_device(self) -> None:
        """Lightning and zcore must put this rank on the same device."""
        zcore_device = init_distributed().device  # the process group Lightning created
        if zcore_device != self.root_device:
            raise ConfigError(
                f"Lightning put this rank on {self.root_device} but zcore computes on {zcore_device} "
                "(LOCAL_RANK's GPU with NCCL, the CPU with gloo); select devices so that each rank's device "
                "is its LOCAL_RANK (devices=N, not a list of indices)"
            )

    def _training_engine(self, trainer: Trainer, module: LightningModule) -> Engine:
        _refuse_for_fit(trainer, module, self._layer_sync is not None)
        optimizer, schedulers = self._module_optimizer(module)
        config = _fit_config(self._config_with_precision(), trainer)
        engine = initialize(model=module, config=config, optimizer=optimizer, meta_init=self._meta_init)[0]
        engine.set_gradient_accumulation_boundary(False)  # ZcorePrecision.optimizer_step says when it is
        if engine.lr_scheduler is not None:
            # The config's schedule, stepped by Lightning at each optimizer step instead of by zcore.
            schedulers = [LRSchedulerConfig(engine.lr_scheduler, interval="step")]
            engine.lr_scheduler = None
        self.optimizers = [engine.optimizer]
        self.lr_scheduler_configs = schedulers
        return engine

    def _module_optimizer(self, module: LightningModule) -> tuple[Optional[Optimizer], list[LRSchedulerConfig]]:
        """``configure_optimizers``' optimizer and schedules; or, where it
        returns None, the config's optimizer section trains (with its
        scheduler section, if any)."""
        if "optimizer" in self._config:
            if module.configure_optimizers() is not None:
                raise ConfigError(
                    f"the zcore config has an optimizer section and {type(module).__name__}.configure_optimizers "
                    "returns an optimizer too: keep one (return None to train with the config's)"
                )
            return None, []
        if "scheduler" in self._config:
            raise ConfigError(
                "the zcore config has a scheduler section but no optimizer section: configure_optimizers' "
                "optimizer has the module's own schedules; put the schedule there, or give the config both"
            )
        optimizers, schedulers = _init_optimizers_and_lr_schedulers(module)
        if isinstance(optimizers[0], _MockOptimizer):
            raise ConfigError(
                f"{type(module).__name__}.configure_optimizers returned None and the zcore config has no "
                "optimizer section: return a torch optimizer over self.parameters(), or add the section"
            )
        return optimizers[0], schedulers

    def _config_with_precision(self) -> dict:
        config = copy.deepcopy(self._config)
        _set_precision(config, self.precision_plugin.precision)
        return config

    # What Lightning would otherwise do with DDP's module and optimizer.
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, torch.Tensor]:
        """Empty: the optimizer states are in zcore's checkpoint."""
        return {}

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Empty: the weights are in zcore's checkpoint (``zcore consolidate``
        writes them as one state dict)."""
        return {}

    def teardown(self) -> None:
        """Not DDP's (which moves the module to the CPU, under zcore's
        shards): the engine stays, for the evaluations after a fit."""
        self.precision_plugin.teardown()
        assert self.accelerator is not None and self.cluster_environment is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()
        self.cluster_environment.teardown()

    # Checkpoints: zcore's, with Lightning's state as the client state.
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine loads it

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # in zcore's checkpoint

    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Writes the directory ``filepath``: every rank its shards, rank 0
        Lightning's state. Call it on every rank (the Trainer does)."""
        if storage_options is not None:
            raise ConfigError(
                "Trainer.save_checkpoint(storage_options=...) is for a CheckpointIO, which zcore does not "
                "use: every rank writes its own shards; drop storage_options"
            )
        if "optimizer_states" not in checkpoint:
            raise ConfigError(
                "a weights-only checkpoint (save_weights_only=True) is not zcore's: its checkpoint holds the "
                "optimizer states beside the weights, sharded; save the whole checkpoint and take the weights "
                "from it with `zcore consolidate PATH OUT`"
            )
        filepath = self.broadcast(filepath)  # rank 0's name (ModelCheckpoint may format it per rank)
        lightning_state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        engine = self._engine_for("save a checkpoint")
        engine.save_checkpoint(filepath, tag=CHECKPOINT_TAG, client_state=lightning_state)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Loads the weights (and when fitting, the optimizer states and
        counters) into the engine at any world size; returns Lightning's
        state. ``weights_only`` is moot: zcore's checkpoints hold JSON and
        tensors, never pickles."""
        if not (Path(checkpoint_path) / CHECKPOINT_TAG).is_dir():
            raise CheckpointError(
                f"ckpt_path {str(checkpoint_path)!r} is not a checkpoint ZcoreStrategy saved (a directory "
                f"holding zcore's sharded checkpoint, tag {CHECKPOINT_TAG!r}); a Lightning checkpoint file of "
                "another strategy holds whole weights: load its 'state_dict' into the module before the fit"
            )
        assert self.lightning_module is not None
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        _, state = self._engine_for("load a checkpoint").load_checkpoint(
            checkpoint_path, tag=CHECKPOINT_TAG, load_lr_scheduler_states=False, load_module_only=not fitting
        )
        return state

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """The engine loaded the weights (``load_checkpoint``)."""

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """The engine loaded the optimizer states (``load_checkpoint``)."""

    def _engine_for(self, doing: str) -> Engine:
        if self.engine is None:
            raise InvalidStateError(
                f"ZcoreStrategy cannot {doing} before the Trainer has set it up (fit, validate, test or predict)"
            )
        return self.engine


@functools.cache
def _warn_if_untested(version: str) -> None:
    """Once per Lightning version seen."""
    if version != TESTED_LIGHTNING:
        log.warning(
            "zcore: ZcoreStrategy is tested with Lightning %s, this is %s: it uses some of the Trainer's "
            "private API, which may have changed", TESTED_LIGHTNING, version,
        )


def _zcore_precision(plugin: Precision) -> ZcorePrecision:
    """The precision plugin Lightning chose for ``Trainer(precision=...)``, as zcore's."""
    if isinstance(plugin, ZcorePrecision):
        return plugin
    if type(plugin) is Precision:
        return ZcorePrecision("32-true")
    if isinstance(plugin, MixedPrecision):
        return ZcorePrecision(plugin.precision)
    raise ConfigError(
        f"Trainer(precision={getattr(plugin, 'precision', None)!r}) ({type(plugin).__name__}) is not zcore's: "
        "zcore keeps fp32 master weights (sharded) and computes in fp32, bf16 or fp16 with them; use "
        "precision='32-true', 'bf16-mixed' or '16-mixed'"
    )


def _agree(section: dict, key: str, value: Any, what: str, source: str) -> None:
    """``section[key] = value``, where the config leaves it out or "auto" or repeats it."""
    given = section.get(key, "auto")
    if given != "auto" and given != value:
        raise ConfigError(
            f"the zcore config's {what} is {given!r} but {source} gives {value!r}; set it in one place "
            "(or give the same value in both)"
        )
    section[key] = value


def _with_zero_settings(
    config: dict, stage: Optional[int], offload_optimizer: bool, offload_parameters: bool
) -> dict:
    """The config with the strategy's own arguments (the registered names') in ``zero_optimization``."""
    zero = config.setdefault("zero_optimization", {})
    if not isinstance(zero, dict):
        return config  # load_config names the problem
    if stage is not None:
        _agree(zero, "stage", stage, "zero_optimization.stage", f"ZcoreStrategy(stage={stage})")
    for key, argument, on in (("offload_optimizer", "offload_optimizer", offload_optimizer),
                              ("offload_param", "offload_parameters", offload_parameters)):
        section = zero.setdefault(key, {}) if on else None
        if isinstance(section, dict):
            _agree(section, "device", "cpu", f"zero_optimization.{key}.device", f"ZcoreStrategy({argument}=True)")
    return config


def _set_precision(config: dict, precision: str) -> None:
    """The config's ``bf16`` and ``fp16`` enabled as the Trainer's precision says."""
    for name, section in _PRECISION_SECTIONS.items():
        wanted = precision == name
        given = config.get(section)
        if given is None:
            if wanted:
                config[section] = {"enabled": True}
            continue
        if not isinstance(given, dict):
            continue  # load_config names the problem
        if "enabled" not in given or given["enabled"] == "auto":
            given["enabled"] = wanted
        elif bool(given["enabled"]) != wanted:
            raise ConfigError(
                f"the zcore config's {section}.enabled is {given['enabled']!r} but Trainer(precision="
                f"{precision!r}) {'asks for' if wanted else 'does not ask for'} {section}; set "
                f"Trainer(precision={name!r}) to train in {section} (its settings from this section), or "
                f"drop {section}.enabled"
            )


def _fit_config(config: dict, trainer: Trainer) -> Config:
    """The config for a fit, completed from the Trainer."""
    _agree(config, "gradient_accumulation_steps", trainer.accumulate_grad_batches,
           "gradient_accumulation_steps", "Trainer(accumulate_grad_batches)")
    if trainer.gradient_clip_val is not None:
        _agree(config, "gradient_clipping", float(trainer.gradient_clip_val), "gradient_clipping",
               "Trainer(gradient_clip_val)")
    if config.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        config["train_micro_batch_size_per_gpu"] = _loader_batch_size(trainer)
    return load_config(config)


def _loader_batch_size(trainer: Trainer) -> int:
    """The training loader's batch size, found as Lightning's DeepSpeed strategy finds it."""
    source = trainer.fit_loop._data_source
    loader = source.dataloader() if source.is_defined() else None
    batch_size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    if not isinstance(batch_size, int):
        raise ConfigError(
            "the training loader has no batch size to read (a custom batch sampler, or none): set "
            "train_micro_batch_size_per_gpu in the zcore config (it counts samples, for the step records)"
        )
    return batch_size


def _evaluation_config(config: dict) -> Config:
    """The config of an engine for validate, test or predict before any fit:
    without what only training uses (ZeRO-Inference)."""
    for key in ("optimizer", "scheduler"):
        config.pop(key, None)
    zero = config.get("zero_optimization")
    if isinstance(zero, dict):
        zero.pop("offload_optimizer", None)
    return load_config(config)


def _refuse_for_fit(trainer: Trainer, module: LightningModule, sync_batchnorm: bool) -> None:
    """What Lightning offers for a fit that zcore would not honour."""
    name = type(module).__name__
    refusals = [
        (not module.automatic_optimization, (
            f"{name} uses manual optimization; zcore must know at each backward whether it ends an "
            "accumulation (it reduces the gradients then), which Lightning's automatic optimization tells "
            "it: set automatic_optimization = True")),
        (trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE, (
            "Trainer(gradient_clip_algorithm='value'): zcore clips by the global norm of the sharded "
            "gradients; use gradient_clip_algorithm='norm'")),
        (is_overridden("configure_gradient_clipping", module, LightningModule), (
            f"{name} overrides configure_gradient_clipping, which would see no gradients (they are zcore's "
            "shards); clip with Trainer(gradient_clip_val=...), by norm in zcore's step")),
        (is_overridden("backward", module, LightningModule), (
            f"{name} overrides backward, which zcore runs itself (loss scaling, gradients reduced as they "
            "come); remove the override")),
        (sync_batchnorm, (
            "Trainer(sync_batchnorm=True) converts the module for DDP, which zcore does not do; convert it "
            "in configure_model with torch.nn.SyncBatchNorm.convert_sync_batchnorm")),
    ]
    for refused, reason in refusals:
        if refused:
            raise ConfigError(reason)


ZcoreStrategy.register_strategies(StrategyRegistry)
