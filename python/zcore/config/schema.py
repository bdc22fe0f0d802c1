"""zcore's configuration: DeepSpeed's JSON keys, validated with pydantic.

A DeepSpeed user keeps their config file. Every key zcore implements has
DeepSpeed's name, default and meaning; a key zcore deliberately does not
implement is refused with the reason (it is accepted only when it carries
DeepSpeed's default, which changes nothing); an unknown key or a wrong type is
refused naming the key and what is allowed.
"""

from __future__ import annotations

import difflib
import json
import math
from pathlib import Path
from typing import Any, ClassVar, Literal, Optional, Union, get_args

from pydantic import (
    BaseModel,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from zcore.config.files import read_config_file
from zcore.config.keys import UNSUPPORTED_KEYS, show_value, translate
from zcore.config.leaf_modules import LeafModuleConfig
from zcore.config.scheduler import SchedulerConfig
from zcore.config.section import MAX_CONFIG_INT, Section
from zcore.errors import ConfigError
from zcore.config.optimizer import OptimizerConfig

Auto = Literal["auto"]


class BF16Config(Section):
    enabled: bool = False
    # zcore's own key: floating-point buffers keep their dtype (a rotary
    # embedding's inv_freq in bf16 is off by radians at long positions)
    # unless this casts them to the compute dtype, as DeepSpeed does.
    cast_buffers: bool = False
    # DeepSpeed's leaner states: master weights (and the gradients the
    # optimizer takes) in bf16, and with them Adam's moments in bf16.
    bf16_master_weights_and_grads: bool = False
    bf16_optimizer_states: bool = False
    # DeepSpeed's default (0.19.8): a step whose gradients are not finite is
    # skipped, as fp16's are; false applies them as they are.
    check_grad_overflow: bool = True

    @model_validator(mode="after")
    def _states_need_master(self) -> BF16Config:
        if self.bf16_optimizer_states and not self.bf16_master_weights_and_grads:
            raise ValueError(
                "bf16.bf16_optimizer_states needs bf16.bf16_master_weights_and_grads (as in DeepSpeed): "
                "set it true too, or drop bf16_optimizer_states"
            )
        if self.bf16_master_weights_and_grads and not self.enabled:
            raise ValueError(
                "bf16.bf16_master_weights_and_grads keeps the master weights in bf16, which needs bf16 "
                "training: set bf16.enabled true, or drop bf16_master_weights_and_grads"
            )
        return self


class FP16Config(Section):
    enabled: bool = False
    cast_buffers: bool = False  # as in bf16
    # 0 selects dynamic loss scaling; a positive value is a static scale.
    loss_scale: float = Field(0.0, ge=0)
    initial_scale_power: int = Field(16, ge=0, le=64)
    loss_scale_window: int = Field(1000, gt=0)
    hysteresis: int = Field(2, gt=0)
    consecutive_hysteresis: bool = False
    min_loss_scale: float = Field(1.0, gt=0)


class _OffloadSection(Section):
    key: ClassVar[str]  # the section's key under zero_optimization, for messages
    # "nvme": what is offloaded lives in files under nvme_path, read through
    # host memory ahead of its use and written back after.
    device: Literal["none", "cpu", "nvme"] = "none"
    # A directory on a fast local disk; ignored unless device is "nvme" (as in
    # DeepSpeed). Created at initialize where missing (as DeepSpeed does);
    # one that cannot be created or written is an error there.
    nvme_path: Optional[str] = None

    @model_validator(mode="after")
    def _nvme_needs_a_path(self) -> _OffloadSection:
        if self.device == "nvme" and not self.nvme_path:
            raise ValueError(
                f"zero_optimization.{self.key}.nvme_path is required when "
                f"zero_optimization.{self.key}.device is 'nvme'; set it to a directory on a fast "
                "local disk"
            )
        return self


class OffloadOptimizerConfig(_OffloadSection):
    key: ClassVar[str] = "offload_optimizer"
    pin_memory: bool = False  # page-locked master shards (on a GPU machine)
    # NVMe: host buffers of sub_group_size elements for swapping optimizer
    # states (DeepSpeed: at least one per tensor Adam keeps); bounds host memory.
    buffer_count: int = Field(4, ge=1)
    # NVMe: read the next sub-group while this one steps, and write the
    # previous one meanwhile. zcore's defaults are true (DeepSpeed's false):
    # without them a step waits for every read and write in turn.
    pipeline_read: bool = True
    pipeline_write: bool = True
    # NVMe: DeepSpeed's direct first write of the optimizer states; zcore's
    # first write is always direct (one sub-group at a time), so either value
    # gives the same start.
    fast_init: bool = False


class OffloadParamConfig(_OffloadSection):
    key: ClassVar[str] = "offload_param"
    # Stage 3: where each rank's parameter shards rest between uses; "cpu"
    # copies a shard to the device just ahead of its all-gather.
    pin_memory: bool = False  # page-locked host shards (on a GPU machine)
    # NVMe, in DeepSpeed: host staging buffers for swapping parameters in.
    # zcore sizes its staging from the model; these bound the host memory it
    # may take (explicit values too small for the model are refused at
    # initialize, where the model is known).
    buffer_count: int = Field(5, ge=1)  # staging buffers
    buffer_size: int = Field(100_000_000, gt=0)  # elements per staging buffer
    # NVMe, as DeepSpeed: this many elements of a rank's shards stay in host
    # memory (the first groups, up to the first that does not fit); the
    # rest go to NVMe. 0 puts every offloaded shard on NVMe.
    max_in_cpu: int = Field(1_000_000_000, ge=0)


class AioConfig(Section):
    """The asynchronous I/O engine behind NVMe offload (DeepSpeed's "aio")."""

    # Bytes per I/O request: a multiple of 4096, which O_DIRECT needs, and
    # at most 1 GiB (Linux moves at most 2 GiB - 4 KiB per request).
    block_size: int = Field(1_048_576, gt=0, le=1 << 30)
    # The I/O engine's bounds (zcore/aio_engine.h).
    queue_depth: int = Field(8, gt=0, le=1024)  # requests in flight per worker thread
    intra_op_parallelism: int = Field(1, ge=1, le=64)  # worker threads sharing each read or write

    @field_validator("block_size")
    @classmethod
    def _aligned_block(cls, v: int) -> int:
        if v % 4096:
            raise ValueError(
                "must be a multiple of 4096 bytes (the alignment O_DIRECT needs); 1048576 is the default"
            )
        return v


class CheckpointConfig(Section):
    """DeepSpeed's "checkpoint" section. zcore always checks that every rank
    saves or loads the same tag (they write one directory together, so
    differing tags cannot work): "Warn" and "Ignore" are accepted for
    DeepSpeed configs and checked as "Fail" is."""

    tag_validation: str = "Warn"
    # zcore's own: what engine.save_checkpoint does when not told (async_save=None).
    async_save: bool = False

    @field_validator("tag_validation")
    @classmethod
    def _mode(cls, v: str) -> str:
        if v.upper() not in ("WARN", "IGNORE", "FAIL"):
            raise ValueError(f"must be 'Warn', 'Ignore' or 'Fail' (any case), got {show_value(v)}")
        return v


class TensorBoardConfig(Section):
    """DeepSpeed's "tensorboard" section: per-step metrics as TensorBoard
    events in ``output_path/job_name`` (rank 0; ``tensorboard`` installed)."""

    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


class CSVMonitorConfig(TensorBoardConfig):
    """DeepSpeed's "csv_monitor" section: one CSV file per metric in
    ``output_path/job_name`` (rank 0), the files ``zcore plot`` reads."""


class WandbConfig(Section):
    """DeepSpeed's "wandb" section (rank 0; ``wandb`` installed). Offline
    runs follow wandb's own ``WANDB_MODE=offline``."""

    enabled: bool = False
    group: Optional[str] = None
    team: Optional[str] = None
    project: str = "deepspeed"


class FlopsProfilerConfig(Section):
    """DeepSpeed's "flops_profiler" section: at step ``profile_step``, each
    module's parameters, FLOPs and latency (zcore.observe.flops_profiler)."""

    enabled: bool = False
    recompute_fwd_factor: float = Field(0.0, ge=0)
    profile_step: int = Field(1, ge=1)
    module_depth: int = Field(-1, ge=-1)
    top_modules: int = Field(1, ge=1)
    detailed: bool = True
    output_file: Optional[str] = None


class OutOfStepCheckConfig(Section):
    """zcore's own: ranks whose engine calls fell out of step (one rank's
    call raised and it went on) raise on every rank, naming the rank,
    instead of waiting until the process group's timeout
    (zcore.engine.rank_calls)."""

    enabled: bool = True
    # How long a rank whose call raised waits, at its next call, for every
    # peer to say where it is (peers stuck in zcore's collectives say so
    # within a second or two).
    patience_seconds: float = Field(300.0, gt=0)


class ZeroConfig(Section):
    stage: Literal[0, 1, 2, 3] = 0
    reduce_bucket_size: int = Field(500_000_000, gt=0)
    allgather_bucket_size: int = Field(500_000_000, gt=0)
    offload_optimizer: OffloadOptimizerConfig = OffloadOptimizerConfig()
    offload_param: OffloadParamConfig = OffloadParamConfig()
    # Optimizer states on NVMe are stepped and swapped in sub-groups of at
    # most this many elements; unset, zcore sizes them to the host memory
    # available (zcore.step.swapped_optimizer).
    sub_group_size: int = Field(1_000_000_000, gt=0)
    # Stage 3, in parameter elements (DeepSpeed's names and defaults).
    stage3_prefetch_bucket_size: int = Field(50_000_000, ge=0)
    stage3_max_live_parameters: int = Field(1_000_000_000, ge=0)
    stage3_max_reuse_distance: int = Field(1_000_000_000, ge=0)
    stage3_param_persistence_threshold: int = Field(100_000, ge=0)
    # trainer.save_model() writes the weights in the compute dtype (bf16 or
    # fp16), as DeepSpeed's Trainer integration does with this key; without
    # it, zcore writes the fp32 master weights. Streamed either way.
    stage3_gather_16bit_weights_on_model_save: bool = False
    # When ZeRO-3 checks that every rank is about to gather the same groups
    # (zcore.zero3.recording_checks): "recording" only where no trace foresees the
    # use; "every_module" at every module, which also catches ranks where
    # some follow their trace and others leave it, at one small all-reduce
    # per module call (and a host sync on GPU): for debugging a hang.
    stage3_rank_agreement_check: Literal["recording", "every_module"] = "recording"
    # ZeRO++ (zcore.comm.quantized_collectives): stage 3's weight all-gathers in
    # int8, the gradient reduce-scatters (stages 1-3) in int4.
    zero_quantized_weights: bool = False
    zero_quantized_gradients: bool = False
    # ZeRO++ hpZ (zcore.zero3.secondary_partition): stage 3 keeps a secondary
    # partition of gathered groups within blocks of this many ranks (a
    # node), so that later gathers stay within the block; 0 and 1: none.
    zero_hpz_partition_size: int = Field(1, ge=0)
    # MiCS: stage 3 shards within groups of this many consecutive ranks and
    # replicates across the groups (-1: over the whole world); the
    # parameter all-gathers of a group spanning nodes in two levels.
    mics_shard_size: int = Field(-1, ge=-1)
    mics_hierarchical_params_gather: bool = False
    # Stage 3: modules gathered whole when entered (zcore.zero3.leaf_modules).
    leaf_module: LeafModuleConfig = Field(default_factory=LeafModuleConfig)

    @field_validator("offload_optimizer", "offload_param", mode="before")
    @classmethod
    def _null_offload(cls, v: Any) -> Any:
        return {} if v is None else v

    @model_validator(mode="after")
    def _zero_plus_plus_at_their_stages(self) -> ZeroConfig:
        if self.zero_quantized_weights and self.stage != 3:
            raise ValueError(
                f"zero_optimization.zero_quantized_weights quantizes stage 3's parameter all-gathers, but "
                f"zero_optimization.stage is {self.stage}, which gathers none; set the stage to 3 or remove the key"
            )
        if self.zero_quantized_gradients and self.stage == 0:
            raise ValueError(
                "zero_optimization.zero_quantized_gradients quantizes the gradient reduce-scatters of stages 1-3; "
                "stage 0 all-reduces whole gradients instead; set the stage to 1, 2 or 3 or remove the key"
            )
        if self.mics_shard_size == 0:
            raise ValueError(
                "zero_optimization.mics_shard_size = 0 shards over no rank; set it to the ranks each copy "
                "of the model is sharded over (a divisor of the world size), or -1 to turn MiCS off"
            )
        mics = self.mics_shard_size > 0
        if mics and self.stage != 3:
            raise ValueError(
                f"zero_optimization.mics_shard_size = {self.mics_shard_size} shards stage 3's parameters "
                f"within groups of ranks, but zero_optimization.stage is {self.stage}; set the stage to 3 "
                "(as DeepSpeed's MiCS requires) or the key to -1"
            )
        if self.mics_hierarchical_params_gather and not mics:
            raise ValueError(
                "zero_optimization.mics_hierarchical_params_gather gathers MiCS shard groups that span "
                "nodes in two levels, but mics_shard_size is -1 (MiCS off); set mics_shard_size or "
                "remove the key"
            )
        if mics and self.zero_hpz_partition_size > 1:
            raise ValueError(
                f"zero_optimization.zero_hpz_partition_size = {self.zero_hpz_partition_size} and "
                f"mics_shard_size = {self.mics_shard_size} both choose where stage 3's gathers run: "
                "MiCS shards within its groups, so every gather stays there already; keep one"
            )
        if self.zero_hpz_partition_size > 1 and self.stage != 3:
            raise ValueError(
                f"zero_optimization.zero_hpz_partition_size = {self.zero_hpz_partition_size} keeps a secondary "
                f"partition of stage 3's gathered parameters, but zero_optimization.stage is {self.stage}, which "
                "gathers none; set the stage to 3, or the key to 1"
            )
        return self

    @model_validator(mode="after")
    def _param_offload_at_stage_3(self) -> ZeroConfig:
        if self.offload_param.device != "none" and self.stage != 3:
            raise ValueError(
                f"zero_optimization.offload_param.device = {self.offload_param.device!r} needs "
                f"zero_optimization.stage = 3, where parameters are sharded (it is {self.stage}); set "
                "the stage to 3 or offload_param.device to 'none'"
            )
        return self


class Config(Section):
    """A DeepSpeed-style training config, validated: every key DeepSpeed
    documents that zcore implements, under DeepSpeed's names and defaults;
    an unknown key, a wrong type or inconsistent batch sizes is a
    ConfigError naming the key (docs/reference/config.md lists them all)."""

    train_batch_size: Union[int, Auto, None] = None
    train_micro_batch_size_per_gpu: Union[int, Auto, None] = None
    gradient_accumulation_steps: Union[int, Auto, None] = None
    # DeepSpeed 0.19.8's default: a DeepSpeed config that leaves it out clips at 1.0.
    gradient_clipping: float = Field(1.0, ge=0)
    optimizer: Optional[OptimizerConfig] = None
    scheduler: Optional[SchedulerConfig] = None
    bf16: BF16Config = BF16Config()
    fp16: FP16Config = FP16Config()
    zero_optimization: ZeroConfig = ZeroConfig()
    aio: AioConfig = AioConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    communication_data_type: Optional[Literal["fp32", "fp16", "bf16"]] = None
    steps_per_print: int = Field(10, gt=0)
    wall_clock_breakdown: bool = False
    tensorboard: TensorBoardConfig = TensorBoardConfig()
    csv_monitor: CSVMonitorConfig = CSVMonitorConfig()
    wandb: WandbConfig = WandbConfig()
    flops_profiler: FlopsProfilerConfig = FlopsProfilerConfig()
    out_of_step_check: OutOfStepCheckConfig = OutOfStepCheckConfig()
    zero_allow_untested_optimizer: bool = False
    # The loader zcore.initialize(training_data=...) builds drops each rank's
    # last, incomplete micro-batch (DeepSpeed's deepspeed_io does the same).
    dataloader_drop_last: bool = False
    # What became of the DeepSpeed keys that are not zcore's own
    # (zcore.config.keys): tuning keys zcore decides itself, and top-level
    # keys neither DeepSpeed nor zcore reads; zcore.initialize reports both.
    _deepspeed_decided: tuple[str, ...] = PrivateAttr(default=())
    _ignored_keys: tuple[str, ...] = PrivateAttr(default=())

    @field_validator("steps_per_print", mode="before")
    @classmethod
    def _never_print(cls, v: Any) -> Any:
        # Accelerate writes Infinity (JSON's extension) to mean never, and
        # DeepSpeed's own default, null, means never too: a step count no run
        # reaches is the same.
        return MAX_CONFIG_INT if v is None or (isinstance(v, float) and v == math.inf) else v

    @field_validator("communication_data_type", mode="before")
    @classmethod
    def _any_case(cls, v: Any) -> Any:
        return v.lower() if isinstance(v, str) else v  # as DeepSpeed reads it

    @field_validator("aio", mode="before")
    @classmethod
    def _null_aio(cls, v: Any) -> Any:
        return {} if v is None else v  # DeepSpeed reads "aio": null as its defaults

    @model_validator(mode="after")
    def _one_precision(self) -> Config:
        if self.bf16.enabled and self.fp16.enabled:
            raise ValueError("bf16.enabled and fp16.enabled are both true; enable at most one")
        params = getattr(self.optimizer, "params", None)
        if getattr(params, "fp32_optimizer_states", True) is False and not self.bf16.bf16_optimizer_states:
            raise ValueError(
                "optimizer.params.fp32_optimizer_states is false, but zcore keeps Adam's moments in bf16 only "
                "with bf16.bf16_optimizer_states (and bf16_master_weights_and_grads): set those true, or remove "
                "fp32_optimizer_states"
            )
        return self

    def ignored_keys_line(self) -> Optional[str]:
        """The warning for top-level keys neither DeepSpeed nor zcore reads
        (None without any), with the nearest known key where one is near:
        DeepSpeed ignores them silently, so a misspelt key would go unseen."""
        if not self._ignored_keys:
            return None
        known = [*Config.model_fields, *(key.split(".")[0] for key in UNSUPPORTED_KEYS)]
        named = []
        for key in self._ignored_keys:
            near = difflib.get_close_matches(key, known, n=1)
            named.append(f"{key!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
        return (
            f"zcore: config key(s) {', '.join(named)}: neither DeepSpeed nor zcore reads "
            f"{'it' if len(named) == 1 else 'them'}; ignored, as DeepSpeed ignores them"
        )

    def decided_keys_line(self) -> Optional[str]:
        """The line listing the DeepSpeed tuning keys the config gives, each
        with what zcore does instead (None without any)."""
        if not self._deepspeed_decided:
            return None
        return "zcore: DeepSpeed config keys zcore decides itself: " + "; ".join(self._deepspeed_decided)

    @property
    def records_step_metrics(self) -> bool:
        """Whether the engine measures each step (zcore.observe.step_metrics)."""
        return (
            self.wall_clock_breakdown or self.tensorboard.enabled or self.csv_monitor.enabled or self.wandb.enabled
        )

    def batch_sizes(self, world_size: int) -> tuple[int, int, int]:
        """(train_batch_size, micro_batch_per_rank, gradient_accumulation_steps).

        DeepSpeed's rule: train_batch_size = micro x accumulation x world_size;
        any one of the three may be omitted (or "auto") and is inferred.
        """
        return resolve_batch_sizes(
            _given(self.train_batch_size),
            _given(self.train_micro_batch_size_per_gpu),
            _given(self.gradient_accumulation_steps),
            world_size,
        )


def _given(value: Union[int, str, None]) -> Optional[int]:
    return None if value is None or value == "auto" else int(value)


def resolve_batch_sizes(
    train: Optional[int], micro: Optional[int], gas: Optional[int], world_size: int
) -> tuple[int, int, int]:
    for key, value in (
        ("train_batch_size", train),
        ("train_micro_batch_size_per_gpu", micro),
        ("gradient_accumulation_steps", gas),
    ):
        if value is not None and value <= 0:
            raise ConfigError(f"config key {key!r} must be a positive integer, got {value}")
    if train is not None and micro is not None and gas is not None:
        if train != micro * gas * world_size:
            raise ConfigError(
                f"inconsistent batch sizes: train_batch_size ({train}) must equal "
                f"train_micro_batch_size_per_gpu ({micro}) x gradient_accumulation_steps ({gas}) "
                f"x world size ({world_size}) = {micro * gas * world_size}; fix one of them or "
                "leave one out (or 'auto') to have it inferred"
            )
        return train, micro, gas
    if train is not None and micro is not None:
        gas, rest = divmod(train, micro * world_size)
        if rest or gas == 0:
            raise ConfigError(
                f"train_batch_size ({train}) is not a multiple of train_micro_batch_size_per_gpu "
                f"({micro}) x world size ({world_size}); adjust one of them"
            )
        return train, micro, gas
    if train is not None:
        gas = gas or 1
        micro, rest = divmod(train, gas * world_size)
        if rest or micro == 0:
            raise ConfigError(
                f"train_batch_size ({train}) is not a multiple of gradient_accumulation_steps "
                f"({gas}) x world size ({world_size}); adjust one of them"
            )
        return train, micro, gas
    if micro is not None:
        gas = gas or 1
        return micro * gas * world_size, micro, gas
    raise ConfigError(
        "the config must give train_batch_size or train_micro_batch_size_per_gpu (or both); "
        "gradient_accumulation_steps alone cannot determine the batch size"
    )


def load_config(config: Union[Config, dict, str, Path, None]) -> Config:
    """A validated Config from a dict, a JSON file path, or a Config."""
    if isinstance(config, Config):
        return config
    if config is None:
        raise ConfigError("zcore.initialize needs a config (a dict or a path to a JSON file)")
    if isinstance(config, (str, Path)):
        path = Path(config)
        raw = read_config_file(path)
        try:
            return _validate(raw)
        except ConfigError as exc:
            raise ConfigError(f"config file {str(path)!r}: {exc}") from None
    if isinstance(config, dict):
        return _validate(config)
    raise ConfigError(
        f"config must be a dict, a path to a JSON file or a zcore Config, got "
        f"{type(config).__name__}"
    )


def _validate(raw: dict) -> Config:
    translation = translate(raw, Config.model_fields)
    if translation.problems:
        raise ConfigError("\n".join(translation.problems))
    try:
        config = Config.model_validate(translation.config)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, translation.renamed)) from None
    config._deepspeed_decided = tuple(translation.decided)
    config._ignored_keys = tuple(translation.ignored)
    return config


def _describe(exc: ValidationError, renamed: dict[str, str]) -> str:
    """One line per key in ``exc``, each named as the config wrote it
    (``renamed``: zcore's key for each DeepSpeed alias the config used)."""
    problems: dict[str, list[str]] = {}
    for err in exc.errors():
        if err["type"] == "extra_forbidden":
            section, model = _walk(err["loc"][:-1])
            key = _as_written(".".join([*section, str(err["loc"][-1])]), renamed)
            text = _unknown_key(key, sorted(getattr(model, "model_fields", {})))
        elif err.get("input") == "auto":
            key = _as_written(".".join(_walk(err["loc"])[0]), renamed)
            text = _auto_outside_trainer(key or "config", _default_at(err["loc"]))
        else:
            key = _as_written(".".join(_walk(err["loc"])[0]), renamed)
            text = f"{key or 'config'}: {err['msg']} (got {show_value(err.get('input'))})"
        problems.setdefault(key, []).append(text)
    # A value that fails every branch of a union (an int or "auto", say)
    # gives one error per branch: show them as one line.
    lines = [" / ".join(dict.fromkeys(texts)) for texts in problems.values()]
    return f"invalid zcore config ({len(lines)} problem(s)):\n  " + "\n  ".join(lines)


def _as_written(key: str, renamed: dict[str, str]) -> str:
    for target, alias in renamed.items():
        if key == target or key.startswith(target + "."):
            return alias + key[len(target):]
    return key


def _unknown_key(key: str, allowed: list[str]) -> str:
    *section, leaf = key.split(".")
    near = difflib.get_close_matches(leaf, allowed, n=1)
    guess = f"; did you mean {'.'.join([*section, near[0]])!r}? Allowed" if near else "; allowed"
    return f"unknown key {key!r}{guess} here: {', '.join(allowed) or '(none)'}"


# The keys whose "auto" zcore.trainer.ZcoreTrainer fills in, and from what
# (zcore.trainer's _config_from; DeepSpeed configs written for transformers
# carry "auto" there). The batch-size keys take "auto" anywhere: inferred.
TRAINER_AUTO_KEYS: dict[str, str] = {
    "gradient_clipping": "max_grad_norm",
    "optimizer.params.lr": "learning_rate",
    "optimizer.params.betas": "adam_beta1 and adam_beta2",
    "optimizer.params.eps": "adam_epsilon",
    "optimizer.params.weight_decay": "weight_decay",
    "bf16.enabled": "bf16",
    "fp16.enabled": "false: TrainingArguments.fp16 stays off, zcore's fp16 is set in its config",
    "scheduler.params.warmup_min_lr": "0",
    "scheduler.params.warmup_max_lr": "learning_rate",
    "scheduler.params.warmup_num_steps": "warmup_steps or warmup_ratio",
    "scheduler.params.total_num_steps": "max_steps, or the epochs' steps",
}


def _auto_outside_trainer(key: str, default: Any) -> str:
    fix = "put a value there instead" + (f" (or remove the key for the default, {_as_json(default)})"
                                         if default is not None else "")
    source = TRAINER_AUTO_KEYS.get(key)
    if source is not None:
        return (
            f'{key} = "auto": "auto" is resolved only by zcore.trainer.ZcoreTrainer, from its '
            f"TrainingArguments ({source}); zcore.initialize takes the config as given: {fix}"
        )
    return (
        f'{key} = "auto": "auto" is resolved only by zcore.trainer.ZcoreTrainer, from its TrainingArguments, '
        f"and only at {', '.join(TRAINER_AUTO_KEYS)} (the batch sizes infer it anywhere); {fix}"
    )


def _as_json(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return show_value(value)


def _default_at(loc: tuple) -> Any:
    """The default of the key at an error location, or None where it has none."""
    *parent, leaf = map(str, loc) if loc else ("",)
    model = _walk(tuple(parent))[1]
    field = getattr(model, "model_fields", {}).get(leaf)
    if field is None or field.is_required():
        return None
    default = field.get_default(call_default_factory=True)
    return None if isinstance(default, BaseModel) else default  # a section: no one value to name


def _walk(loc: tuple) -> tuple[list[str], Any]:
    """The key path of an error location (union-branch tags skipped), and the
    section model it leads to (None for a plain value)."""
    models: list[Any] = [Config]
    path = []
    for part in map(str, loc):
        owner = next((m for m in models if part in getattr(m, "model_fields", {})), None)
        if owner is not None:
            path.append(part)
            models = _models_in(owner.model_fields[part].annotation)
        else:
            named = [m for m in models if _branch_tag(m) == part]
            models = named or models
    return path, (models[0] if models else None)


def _models_in(annotation: Any) -> list[Any]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def _branch_tag(model: Any) -> str:
    field = getattr(model, "model_fields", {}).get("type")
    args = get_args(field.annotation) if field is not None else ()
    return str(args[0]) if len(args) == 1 else model.__name__


__all__ = ["Config", "ConfigError", "UNSUPPORTED_KEYS", "load_config", "resolve_batch_sizes"]
