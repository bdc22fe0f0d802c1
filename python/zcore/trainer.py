"""transformers' Trainer, training on a zcore engine.

    from zcore.trainer import ZcoreTrainer

    trainer = ZcoreTrainer(
        model=model, args=TrainingArguments(...), train_dataset=..., eval_dataset=...,
        zcore_config={"zero_optimization": {"stage": 3}},
    )
    trainer.train()  # or trainer.train(resume_from_checkpoint=True)

Launched as any Trainer script is (``torchrun --nproc_per_node=N``; on a
machine without a GPU with ``TrainingArguments(use_cpu=True)``, without
which Accelerate counts one process whatever the launcher started: the
Trainer and zcore must see the same ranks, and a difference is refused). The
Trainer keeps its loop, data loading, evaluation, logging, callbacks,
learning-rate schedule and checkpoint rotation; zcore owns the parameters,
gradients, optimizer step and precision.

Why a subclass: Trainer and Accelerate recognise only their own engines
(DeepSpeed, FSDP, Megatron) through closed lists, and pretending to be
DeepSpeed would tie zcore to DeepSpeed's internals as transformers calls
them. Trainer's documented extension point is subclassing: this overrides
where the model is wrapped (the engine), the training step (zcore's
backward and step, at the boundaries the Trainer decides), the optimizer
handed to the schedule (zcore's parameter groups), and where weights and
optimizer states are saved and loaded. Some of those methods are private,
so the transformers version is pinned (5.24.0) in the tests.

From the TrainingArguments, unless the zcore config sets them:
- ``train_micro_batch_size_per_gpu`` and ``gradient_accumulation_steps``
  (the config may repeat them, not differ);
- ``gradient_clipping`` from ``max_grad_norm``;
- an AdamW from ``learning_rate``, ``adam_beta1/2``, ``adam_epsilon`` and
  ``weight_decay``, over transformers' decay and no-decay groups;
- ``bf16``. fp16 is zcore's own (dynamic loss scaling): set it in the
  zcore config; ``fp16=True`` in the arguments would bring Accelerate's
  gradient scaler, which never sees zcore's gradients, and is refused.

"auto" in the zcore config (as in DeepSpeed configs written for
transformers) means the same: take it from the TrainingArguments. The
learning-rate schedule is the Trainer's; a ``scheduler`` section is refused.

A checkpoint directory holds the Trainer's files, the weights as
``save_pretrained`` writes them (``zcore.save_pretrained``: fp32 master
weights, loadable with ``from_pretrained``) and zcore's sharded checkpoint
(tag ``zcore``) with the optimizer states, from which training resumes
exactly at the same world size (zcore's checkpoint itself loads at any
world size; the Trainer's data order and per-rank RNG states do not carry
over to another).

Differences from the Trainer's own loop: zcore steps at the end of the
micro-batch that closes an accumulation, so ``on_pre_optimizer_step``
callbacks run after the step; a step zcore skips (fp16 overflow) does not
advance the schedule, as with Accelerate's scaler.
"""

from __future__ import annotations

import copy
import logging
import os
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
import transformers
from transformers.trainer import SCHEDULER_NAME, TRAINING_ARGS_NAME

from zcore.checkpoint.directory import LATEST
from zcore.checkpoint.pretrained import load_pretrained, save_pretrained
from zcore.comm.collectives import DistributedContext, init_distributed
from zcore.config.files import config_dict
from zcore.config.schema import Config, load_config
from zcore.engine.engine import Engine
from zcore.errors import ConfigError
from zcore.optim.lr_schedules import SCHEDULES
from zcore.engine.initialize import initialize

__all__ = ["ZcoreTrainer"]

CHECKPOINT_TAG = "zcore"
TESTED_TRANSFORMERS = "5.24.0"  # the Trainer methods overridden here are private
_ADAMW = {"adamw_torch", "adamw_torch_fused", "adamw_hf"}
log = logging.getLogger("zcore")


class ZcoreTrainer(transformers.Trainer):
    """transformers' Trainer with zcore owning the parameters, gradients,
    optimizer step and precision (the module docstring says what comes from
    the TrainingArguments and what from the zcore config)."""

    def __init__(self, *args: Any, zcore_config: Union[dict, str, os.PathLike, None] = None, **kwargs: Any) -> None:
        """``zcore_config``: zcore's (DeepSpeed-style) config, as a dict or a
        JSON file; what it leaves out comes from the TrainingArguments."""
        optimizers = kwargs.get("optimizers", (None, None))
        if optimizers[0] is not None or optimizers[1] is not None:
            raise ConfigError(
                "ZcoreTrainer builds its optimizer in zcore (from the zcore config or the "
                "TrainingArguments) and its schedule from the TrainingArguments; do not pass optimizers=()"
            )
        super().__init__(*args, **kwargs)
        if transformers.__version__ != TESTED_TRANSFORMERS:
            log.warning(
                "zcore: ZcoreTrainer is tested with transformers %s, this is %s: it overrides some of "
                "the Trainer's private methods, which may have changed",
                TESTED_TRANSFORMERS, transformers.__version__,
            )
        if self.args.n_gpu > 1:
            raise ConfigError(
                f"this process sees {self.args.n_gpu} GPUs and the Trainer would run them as DataParallel "
                "in one process; launch one process per device instead (torchrun --nproc_per_node=N)"
            )
        if self.args.device.type == "cpu" and not dist.is_initialized():
            # use_cpu=True without a launcher (Accelerate set up no group): a
            # group of one over gloo, where zcore would take NCCL on a GPU machine.
            dist.init_process_group(backend="gloo", store=dist.HashStore(), rank=0, world_size=1)
        context = init_distributed()  # the process group zcore trains on: Accelerate's, or the launcher's
        _check_same_world(self.args, context)
        raw = config_dict(zcore_config)
        self._scheduler_section = raw.get("scheduler")
        config = _config_from(self.args, raw, context.world_size, self.model)
        self.engine: Engine = initialize(
            model=self.model, config=config, model_parameters=_decay_groups(self, config)
        )[0]

    # Placement and wrapping: zcore's.
    def _move_model_to_device(self, model: torch.nn.Module, device: torch.device) -> None:
        """zcore places each shard itself; moving the whole model to the
        device first is what ZeRO exists to avoid."""

    def _wrap_model(self, model: torch.nn.Module, training: bool = True, dataloader: Any = None) -> Engine:
        return self.engine

    def create_optimizer(self, model: Optional[torch.nn.Module] = None) -> torch.optim.Optimizer:
        if self.optimizer is None:
            self.optimizer = _EngineOptimizer(self.engine)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        if self.lr_scheduler is None and self._scheduler_section is not None:
            params = _scheduler_from(self.args, self._scheduler_section, num_training_steps)
            self.lr_scheduler = SCHEDULES[params.type](optimizer or self.optimizer, params.params)
        schedule = super().create_scheduler(num_training_steps, optimizer)
        if not isinstance(schedule, (_SkipAwareSchedule, torch.optim.lr_scheduler.ReduceLROnPlateau)):
            self.lr_scheduler = schedule = _SkipAwareSchedule(schedule, self.engine)
        return schedule

    # One micro-batch: the Trainer's loss, zcore's backward and step.
    def training_step(self, model: Any, inputs: dict, num_items_in_batch: Any = None) -> torch.Tensor:
        engine = self.engine
        engine.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(engine, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        # The Trainer's rule: a loss normalised over the whole accumulation
        # (num_items_in_batch) is not divided again.
        scaled = self.loss_is_scaled_for_ga
        if scaled is None:
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or (
                self.compute_loss_func is not None
            )
        if not scaled:
            loss = loss / self.current_gradient_accumulation_steps
        # The Trainer decides the boundary (an epoch's last accumulation may be shorter).
        engine.set_gradient_accumulation_boundary(self.accelerator.sync_gradients)
        engine.backward(loss, scale_wrt_gas=False)
        engine.step()
        return loss.detach()

    def _clip_grad_norm(self, model: Any) -> Optional[float]:
        return self.engine.last_grad_norm  # zcore clipped in its step (gradient_clipping)

    def _get_grad_norm(self, model: Any, grad_norm: Optional[float] = None) -> Optional[float]:
        return self.engine.last_grad_norm

    # Weights and optimizer states.
    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """Writes a directory ``from_pretrained`` loads; call it on every rank."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        sixteen_bit = self.engine.config.zero_optimization.stage3_gather_16bit_weights_on_model_save
        save_pretrained(self.engine, output_dir, dtype=self.engine._compute_dtype() if sixteen_bit else torch.float32)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        self.engine.save_checkpoint(output_dir, tag=CHECKPOINT_TAG)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Optional[torch.nn.Module] = None) -> None:
        """Weights alone only when the checkpoint has no zcore checkpoint
        (``save_only_model``); else they come with the optimizer states."""
        if not os.path.isfile(os.path.join(resume_from_checkpoint, LATEST)):
            load_pretrained(self.engine, resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        if checkpoint is None:
            return
        if os.path.isfile(os.path.join(checkpoint, LATEST)):
            self.engine.load_checkpoint(checkpoint, tag=CHECKPOINT_TAG)
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def _load_best_model(self) -> None:
        load_pretrained(self.engine, self.state.best_model_checkpoint)


class _SkipAwareSchedule:
    """The Trainer's schedule, not advanced past an optimizer step that
    zcore skipped (an fp16 overflow); everything else is the schedule's."""

    def __init__(self, schedule: Any, engine: Engine) -> None:
        self._schedule = schedule
        self._engine = engine
        self._skipped = engine.skipped_steps

    def step(self, *args: Any, **kwargs: Any) -> None:
        skipped, self._skipped = self._skipped, self._engine.skipped_steps
        if self._skipped == skipped:
            self._schedule.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._schedule, name)


class _EngineOptimizer(torch.optim.Optimizer):
    """What the Trainer and its schedule see as the optimizer: zcore's
    parameter groups, whose learning rates the schedule sets. Stepping and
    zeroing happen in the engine (ZcoreTrainer.training_step); the states
    are saved in zcore's checkpoint, not in this object's state dict."""

    def __init__(self, engine: Engine) -> None:  # no Optimizer.__init__: nothing of its own to hold
        self._engine = engine

    @property
    def param_groups(self) -> list[dict]:
        return self._engine.optimizer.param_groups

    @property
    def defaults(self) -> dict:
        return self._engine.optimizer.inner.defaults

    @property
    def state(self) -> Any:
        return self._engine.optimizer.state

    def step(self, closure: Any = None) -> None:
        """The step ran in the engine at the end of the micro-batch."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """zcore's gradients are cleared by its own step."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict:
            raise ConfigError(
                "zcore's optimizer states are loaded from zcore's checkpoint (engine.load_checkpoint), "
                "not from a torch optimizer state dict"
            )


def _check_same_world(args: transformers.TrainingArguments, context: DistributedContext) -> None:
    """The Trainer shards data, sizes batches and saves from rank 0 by what
    Accelerate sees; zcore shards and reduces over the process group. They
    must be the same ranks on the same device type."""
    state = args.distributed_state
    seen = "no Accelerate state" if state is None else f"Accelerate's distributed type {state.distributed_type.value}"
    if args.world_size != context.world_size:
        if not torch.cuda.is_available() and not args.use_cpu:
            fix = ("on a machine without a GPU, pass TrainingArguments(use_cpu=True), with which Accelerate runs "
                   "the launcher's ranks over gloo (without it, Accelerate counts one process whatever the "
                   "launcher started)")
        else:
            fix = ("launch one process per rank with torchrun --nproc_per_node=N (or accelerate launch), "
                   "whose environment (RANK, LOCAL_RANK, WORLD_SIZE) Accelerate and zcore both read")
        raise ConfigError(
            f"the TrainingArguments see {args.world_size} process{'es' * (args.world_size != 1)} ({seen}, "
            f"use_cpu={args.use_cpu}) but the process group zcore trains on (torch.distributed) has "
            f"{context.world_size}: the Trainer would split the data and size batches for {args.world_size}; {fix}"
        )
    if args.device.type != context.device.type:
        raise ConfigError(
            f"the TrainingArguments put batches on {args.device} (use_cpu={args.use_cpu}, {seen}) but zcore "
            f"trains on {context.device} (process group backend {context.backend}); pass use_cpu=True to train "
            "on the CPU over gloo, or launch with torchrun on GPUs without it"
        )


def _config_from(
    args: transformers.TrainingArguments, config: dict, world_size: int, model: Optional[torch.nn.Module] = None
) -> Config:
    """The zcore config: the user's, completed from the TrainingArguments
    (where it leaves a key out or sets it to "auto"), the process group's
    ``world_size`` and the model's hidden size (the bucket sizes), as
    transformers completes a DeepSpeed config. A ``scheduler`` section is
    left out: the Trainer builds it once it knows the number of steps
    (``_scheduler_from``)."""
    config = {key: value for key, value in config.items() if key != "scheduler"}
    _fill_hidden_size_keys(config, model)
    if args.fp16:
        raise ConfigError(
            "TrainingArguments.fp16 would give Accelerate's gradient scaler, which never sees zcore's "
            "gradients; set fp16 in the zcore config instead ({'fp16': {'enabled': true}}: zcore's "
            "dynamic loss scaling) and leave TrainingArguments.fp16 false"
        )
    derived = {
        "train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "train_batch_size": args.per_device_train_batch_size * args.gradient_accumulation_steps * world_size,
    }
    for key, value in derived.items():
        if config.get(key, "auto") not in ("auto", value):
            raise ConfigError(
                f"the zcore config's {key} is {config[key]} but the TrainingArguments give {value}; the "
                "Trainer's data loader and loop follow the TrainingArguments: set it there (or drop it here)"
            )
        config[key] = value
    if config.get("gradient_clipping", "auto") == "auto":
        config["gradient_clipping"] = args.max_grad_norm
    from_args = {
        "lr": args.learning_rate,
        "betas": [args.adam_beta1, args.adam_beta2],
        "eps": args.adam_epsilon,
        "weight_decay": args.weight_decay,
    }
    if "optimizer" not in config:
        optim = str(getattr(args.optim, "value", args.optim))
        if optim not in _ADAMW:
            raise ConfigError(
                f"TrainingArguments.optim {optim!r}: zcore trains with its own optimizers; use one of "
                f"{sorted(_ADAMW)} (an AdamW), or give the zcore config an optimizer section"
            )
        config["optimizer"] = {"type": "AdamW", "params": from_args}
    elif isinstance(config["optimizer"], dict) and isinstance(config["optimizer"].get("params"), dict):
        params = config["optimizer"]["params"]
        params.update({k: from_args[k] for k, v in params.items() if v == "auto" and k in from_args})
    for section, given in (("bf16", args.bf16), ("fp16", False)):
        if isinstance(config.get(section), dict) and config[section].get("enabled") == "auto":
            config[section]["enabled"] = given
    if args.bf16:
        config.setdefault("bf16", {})
        config["bf16"].setdefault("enabled", True)
    return load_config(config)


# The keys transformers sizes from the model's hidden size h when they are
# "auto" (DeepSpeed's other names for them too): h*h, and at stage 3 0.9*h*h
# and 10*h.
_HIDDEN_SIZE_KEYS = {
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
    "param_persistence_threshold": lambda h: 10 * h,
}
_STAGE_3_ONLY = {"stage3_prefetch_bucket_size", "prefetch_bucket_size", "stage3_param_persistence_threshold",
                 "param_persistence_threshold"}


def _fill_hidden_size_keys(config: dict, model: Optional[torch.nn.Module]) -> None:
    zero = config.get("zero_optimization")
    if not isinstance(zero, dict):
        return
    auto = [key for key in _HIDDEN_SIZE_KEYS if isinstance(zero.get(key), str) and zero[key] == "auto"]
    if zero.get("stage") != 3:
        auto = [key for key in auto if key not in _STAGE_3_ONLY]  # left to their defaults, as transformers does
    if not auto:
        return
    hidden = _hidden_size(model)
    if hidden is None:
        raise ConfigError(
            f"the zcore config sets {', '.join('zero_optimization.' + key for key in auto)} to \"auto\", which "
            "the Trainer sizes from the model's hidden size, but the model's config has no hidden_size or "
            "hidden_sizes (nor a text_config with one); put a number there instead"
        )
    config["zero_optimization"] = {**zero, **{key: _HIDDEN_SIZE_KEYS[key](hidden) for key in auto}}


def _hidden_size(model: Optional[torch.nn.Module]) -> Optional[int]:
    """The model's hidden size as transformers finds it (the largest of
    ``hidden_sizes`` where there are several)."""
    model_config = getattr(model, "config", None)
    for source in (model_config, getattr(model_config, "text_config", None)):
        if getattr(source, "hidden_size", None) is not None:
            return int(source.hidden_size)
        if getattr(source, "hidden_sizes", None):
            return int(max(source.hidden_sizes))
    return None


def _scheduler_from(args: transformers.TrainingArguments, section: Any, num_training_steps: int) -> Any:
    """The zcore config's scheduler section with its "auto" filled in as
    transformers fills a DeepSpeed scheduler: warmup_min_lr 0, warmup_max_lr
    the learning rate, total_num_steps the Trainer's steps, warmup_num_steps
    its warm-up steps (at least 1); validated."""
    section = copy.deepcopy(section)
    params = section.get("params") if isinstance(section, dict) else None
    if isinstance(params, dict):
        fills = {
            "warmup_min_lr": 0,
            "warmup_max_lr": args.learning_rate,
            "total_num_steps": num_training_steps,
            "warmup_num_steps": max(1, args.get_warmup_steps(num_training_steps)),
        }
        params.update({k: v for k, v in fills.items() if isinstance(params.get(k), str) and params[k] == "auto"})
    return load_config({"train_batch_size": 1, "scheduler": section}).scheduler


def _decay_groups(trainer: transformers.Trainer, config: Config) -> list[dict]:
    """transformers' split: no weight decay on biases and norms."""
    decay = set(trainer.get_decay_parameter_names(trainer.model))
    params = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]
    weight_decay = config.optimizer.params.weight_decay
    groups = [
        {"params": [p for n, p in params if n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in params if n not in decay], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]
