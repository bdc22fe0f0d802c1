"""Every field a DeepSpeed 0.19.8 config can hold, as DeepSpeed reads it:
the reference that zcore's acceptance of DeepSpeed configs is tested against.

``FIELDS`` has one row per key: its dotted path as the JSON writes it, the
other paths DeepSpeed takes for the same value (pydantic aliases, the field
name behind an alias, deprecated names, the old ``bfloat16`` section), its
type, DeepSpeed's default and one legal, realistic non-default value.
``requires`` is the rest of the config that value needs to be legal (a
stage, an offload device, the optimizer or scheduler type whose parameter it
is). ``COERCIONS`` records what DeepSpeed makes of JSON values of another
type than the field's (``1`` for a bool, ``5e8`` or ``"1e9"`` for an int,
``"auto"``), and ``REMOVED`` the top-level keys DeepSpeed 0.19.8 refuses.

How DeepSpeed reads a config (runtime/config.py, runtime/config_utils.py):

- Top-level keys and the sections read with ``get_scalar_param``
  (activation_checkpointing, aio, flops_profiler, autotuning, checkpoint,
  data_types, pipeline, data_efficiency, expert_parallel) are plain dict
  lookups: an unknown key is ignored, a value is kept as given (no
  coercion; ``"auto"`` for a batch size fails later with a TypeError).
- The pydantic sections (zero_optimization with its offload_* and zenflow,
  fp16, bf16, comms_logger, the monitors, compile, timers, hybrid_engine,
  tensor_parallel, weight_quantization) are ``DeepSpeedConfigModel``:
  pydantic v2 in lax mode with ``extra="forbid"`` (an unknown key is an
  error) and ``populate_by_name=True`` (a field's alias or its name).
  Before validation every key whose value is the string ``"auto"`` is
  dropped, so ``"auto"`` anywhere in these sections means the default.
- Optimizer and scheduler ``params`` are passed as keyword arguments to the
  class DeepSpeed builds (engine.py ``_configure_basic_optimizer``,
  ``_scheduler_from_config``); DeepSpeedConfig itself keeps them raw.

Checked: every row's default, example and aliases, every coercion and every
removed key were run through DeepSpeed 0.19.8's own ``DeepSpeedConfig`` by
``tests/python/data/deepspeed_config_fields_check.py`` (not part of the
test suite: it needs DeepSpeed, which zcore does not install). It sets each
value into an otherwise minimal config and compares the parsed config with
the one parsed without it: the default parses to the same config as leaving
the key out, the example to a different one (the key is read and the value
legal), each alias to the same config as the path. Optimizer parameters are
checked against the signature of the class DeepSpeed builds for that type,
scheduler parameters by building DeepSpeed's scheduler with them. To rerun:

    python3 -m venv /tmp/venv-ds-cfg
    /tmp/venv-ds-cfg/bin/pip install torch==2.13.0
    DS_BUILD_OPS=0 /tmp/venv-ds-cfg/bin/pip install deepspeed==0.19.8
    DS_ACCELERATOR=cpu /tmp/venv-ds-cfg/bin/python \
        tests/python/data/deepspeed_config_fields_check.py

Left out: keys that only a program can set (``tensor_parallel.mpu``,
``tp_group``, ``injection_policy_tuple``, ``dtype``), the parameters of the
Muon and mup optimizers and of torch optimizers named by class, the nested
schedules of data_efficiency's curriculum learning and random-LTD (listed
as whole sections) and expert_parallel's routing keys beyond those below.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple


class _Marker:
    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return self._name


ABSENT = _Marker("ABSENT")  # no default: DeepSpeed acts on the key only when it is given
OMITTED = _Marker("OMITTED")  # a coercion DeepSpeed resolves to leaving the key out
REFUSED = _Marker("REFUSED")  # a value DeepSpeedConfig raises on


class DeepSpeedField(NamedTuple):
    path: str  # dotted, as the JSON writes it
    type: str
    default: Any  # DeepSpeed's; ABSENT where there is none
    example: Any  # legal, realistic and different from the default
    aliases: tuple[str, ...] = ()  # other dotted paths DeepSpeed reads as this one
    requires: dict | None = None  # the rest of the config the example needs
    note: str = ""


def _field(path, type_, default, example, *aliases, requires=None, note=""):
    return DeepSpeedField(path, type_, default, example, tuple(aliases), requires, note)


_STAGE3 = {"zero_optimization": {"stage": 3}}
_OFFLOAD_OPTIMIZER = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
_OFFLOAD_PARAM = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
_ADAMW = {"optimizer": {"type": "AdamW"}}
_LAMB = {"optimizer": {"type": "Lamb"}}
_LION = {"optimizer": {"type": "Lion"}}
_ADAGRAD = {"optimizer": {"type": "Adagrad"}}
_WARMUP_LR = {"scheduler": {"type": "WarmupLR"}}
_WARMUP_DECAY_LR = {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 1000}}}
_WARMUP_COSINE_LR = {"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 1000}}}
_ONE_CYCLE = {"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-5, "cycle_max_lr": 1e-3}}}
_LR_RANGE_TEST = {"scheduler": {"type": "LRRangeTest"}}
_ZENFLOW = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": {}}}
_EXPERT_PARALLEL = {"expert_parallel": {"enabled": True}}

FIELDS: list[DeepSpeedField] = [
    # deepspeed/runtime/config.py (DeepSpeedConfig._initialize_params), runtime/constants.py
    _field("train_batch_size", "int", ABSENT, 32,
           note="derived from the other two and the world size when absent"),
    _field("train_micro_batch_size_per_gpu", "int", ABSENT, 4),
    _field("gradient_accumulation_steps", "int", ABSENT, 4, note="1 when only a batch size is given"),
    _field("managed_gradient_accumulation", "bool", True, False),
    _field("steps_per_print", "int|null", None, 100),
    _field("dump_state", "bool", False, True),
    _field("disable_python_gc", "bool", False, True),
    _field("disable_allgather", "bool", False, True),
    _field("communication_data_type", "fp16|bf16|fp32|null", None, "fp32", note="case-insensitive"),
    _field("seq_parallel_communication_data_type", "fp16|bf16|fp32|null", "fp32", "bf16"),
    _field("prescale_gradients", "bool", False, True),
    _field("gradient_predivide_factor", "float", 1.0, 2.0),
    _field("gradient_allreduce_op", "mean|sum", "mean", "sum", note="sum is refused at stage 3"),
    _field("gradient_clipping", "float", 1.0, 0.5, note="DeepSpeed clips at 1.0 unless told otherwise"),
    _field("zero_allow_untested_optimizer", "bool", False, True),
    _field("zero_force_ds_cpu_optimizer", "bool", True, False),
    _field("wall_clock_breakdown", "bool", False, True),
    _field("memory_breakdown", "bool", False, True),
    _field("vocabulary_size", "int|null", None, 50304, note="only warns when not a multiple of 8"),
    _field("use_data_before_expert_parallelism", "bool", False, True),
    _field("dataloader_drop_last", "bool", False, True),
    _field("log_level", "str|null", None, "warning"),
    _field("sequence_parallel_size", "int", ABSENT, 1,
           note="read in DeepSpeedConfig.__init__: the data-parallel world is the world divided by it"),
    _field("zero_optimization", "dict|bool", ABSENT, True,
           note="legacy form: true is stage 1 (with allgather_size), false stage 0"),
    _field("allgather_size", "int", 500000000, 200000000, requires={"zero_optimization": True},
           note="legacy: allgather_bucket_size for the boolean zero_optimization"),
    _field("optimizer.type", "str|null", None, "AdamW",
           note="adam, adamw, adagrad, lamb, lion, muon, muadam, muadamw, musgd (any case); "
                "otherwise a torch.optim class name, exact case (OneBitAdam etc. are gone in 0.19)"),
    _field("optimizer.legacy_fusion", "bool", False, True),
    _field("scheduler.type", "str|null", None, "WarmupLR",
           note="LRRangeTest, OneCycle, WarmupLR, WarmupDecayLR, WarmupCosineLR, or a torch.optim.lr_scheduler name"),

    # optimizer params: engine.py _configure_basic_optimizer, ops/adam/fused_adam.py (FusedAdam),
    # ops/adam/cpu_adam.py (DeepSpeedCPUAdam, with offload), ops/lamb, ops/lion, ops/adagrad
    _field("optimizer.params.lr", "float", 0.001, 2e-5, requires=_ADAMW),
    _field("optimizer.params.betas", "list[float]", [0.9, 0.999], [0.9, 0.95], requires=_ADAMW),
    _field("optimizer.params.eps", "float", 1e-8, 1e-6, requires=_ADAMW),
    _field("optimizer.params.weight_decay", "float", 0.0, 0.1, requires=_ADAMW),
    _field("optimizer.params.bias_correction", "bool", True, False, requires=_ADAMW),
    _field("optimizer.params.adam_w_mode", "bool", True, False, requires={"optimizer": {"type": "Adam"}},
           note="Adam only: AdamW is always decoupled; popped by the engine"),
    _field("optimizer.params.torch_adam", "bool", False, True, requires=_ADAMW,
           note="popped by the engine: torch.optim.AdamW/Adam instead of FusedAdam"),
    _field("optimizer.params.fp32_optimizer_states", "bool", True, False, requires=_ADAMW,
           note="popped by the engine; used by DeepSpeedCPUAdam (offload)"),
    _field("optimizer.params.lr", "float", 0.001, 0.01, requires=_LAMB),
    _field("optimizer.params.betas", "list[float]", [0.9, 0.999], [0.9, 0.98], requires=_LAMB),
    _field("optimizer.params.eps", "float", 1e-8, 1e-6, requires=_LAMB),
    _field("optimizer.params.eps_inside_sqrt", "bool", False, True, requires=_LAMB),
    _field("optimizer.params.weight_decay", "float", 0.0, 0.01, requires=_LAMB),
    _field("optimizer.params.bias_correction", "bool", True, False, requires=_LAMB),
    _field("optimizer.params.max_grad_norm", "float", 0.0, 1.0, requires=_LAMB),
    _field("optimizer.params.max_coeff", "float", 10.0, 0.3, requires=_LAMB),
    _field("optimizer.params.min_coeff", "float", 0.01, 0.001, requires=_LAMB),
    _field("optimizer.params.lr", "float", 0.001, 1e-4, requires=_LION),
    _field("optimizer.params.betas", "list[float]", [0.9, 0.999], [0.9, 0.99], requires=_LION),
    _field("optimizer.params.weight_decay", "float", 0.0, 0.01, requires=_LION),
    _field("optimizer.params.lr", "float", 0.01, 0.1, requires=_ADAGRAD),
    _field("optimizer.params.eps", "float", 1e-10, 1e-8, requires=_ADAGRAD),
    _field("optimizer.params.weight_decay", "float", 0.0, 0.01, requires=_ADAGRAD),

    # scheduler params: runtime/lr_schedules.py
    _field("scheduler.params.warmup_min_lr", "float", 0.0, 1e-6, requires=_WARMUP_LR),
    _field("scheduler.params.warmup_max_lr", "float|null", None, 1e-3, requires=_WARMUP_LR,
           note="null: the optimizer's lr"),
    _field("scheduler.params.warmup_num_steps", "int", 1000, 100, requires=_WARMUP_LR),
    _field("scheduler.params.warmup_type", "log|linear", "log", "linear", requires=_WARMUP_LR),
    _field("scheduler.params.last_batch_iteration", "int", -1, 10, requires=_WARMUP_LR),
    _field("scheduler.params.total_num_steps", "int", ABSENT, 10000, requires=_WARMUP_DECAY_LR,
           note="required"),
    _field("scheduler.params.warmup_min_lr", "float", 0.0, 1e-6, requires=_WARMUP_DECAY_LR),
    _field("scheduler.params.warmup_max_lr", "float", 0.001, 3e-4, requires=_WARMUP_DECAY_LR),
    _field("scheduler.params.warmup_num_steps", "int", 1000, 100, requires=_WARMUP_DECAY_LR),
    _field("scheduler.params.warmup_type", "log|linear", "log", "linear", requires=_WARMUP_DECAY_LR),
    _field("scheduler.params.total_num_steps", "int", ABSENT, 10000, requires=_WARMUP_COSINE_LR,
           note="required"),
    _field("scheduler.params.warmup_min_ratio", "float", 0.0, 0.1, requires=_WARMUP_COSINE_LR),
    _field("scheduler.params.warmup_num_steps", "int", 1000, 100, requires=_WARMUP_COSINE_LR),
    _field("scheduler.params.cos_min_ratio", "float", 0.0001, 0.1, requires=_WARMUP_COSINE_LR),
    _field("scheduler.params.warmup_type", "log|linear", "log", "linear", requires=_WARMUP_COSINE_LR),
    _field("scheduler.params.cycle_min_lr", "float", ABSENT, 1e-5, requires=_ONE_CYCLE, note="required"),
    _field("scheduler.params.cycle_max_lr", "float", ABSENT, 1e-3, requires=_ONE_CYCLE, note="required"),
    _field("scheduler.params.decay_lr_rate", "float", 0.0, 0.001, requires=_ONE_CYCLE),
    _field("scheduler.params.cycle_first_step_size", "int", 2000, 1000, requires=_ONE_CYCLE),
    _field("scheduler.params.cycle_second_step_size", "int|null", None, 500, requires=_ONE_CYCLE),
    _field("scheduler.params.cycle_first_stair_count", "int", 0, 10, requires=_ONE_CYCLE),
    _field("scheduler.params.cycle_second_stair_count", "int|null", None, 10, requires=_ONE_CYCLE),
    _field("scheduler.params.decay_step_size", "int", 0, 100, requires=_ONE_CYCLE),
    _field("scheduler.params.cycle_momentum", "bool", True, False, requires=_ONE_CYCLE),
    _field("scheduler.params.cycle_min_mom", "float", 0.8, 0.85, requires=_ONE_CYCLE),
    _field("scheduler.params.cycle_max_mom", "float", 0.9, 0.95, requires=_ONE_CYCLE),
    _field("scheduler.params.decay_mom_rate", "float", 0.0, 0.001, requires=_ONE_CYCLE),
    _field("scheduler.params.lr_range_test_min_lr", "float", 0.001, 1e-5, requires=_LR_RANGE_TEST),
    _field("scheduler.params.lr_range_test_step_size", "int", 2000, 500, requires=_LR_RANGE_TEST),
    _field("scheduler.params.lr_range_test_step_rate", "float", 1.0, 5.0, requires=_LR_RANGE_TEST),
    _field("scheduler.params.lr_range_test_staircase", "bool", False, True, requires=_LR_RANGE_TEST),

    # deepspeed/runtime/zero/config.py (DeepSpeedZeroConfig)
    _field("zero_optimization.stage", "0|1|2|3", 0, 2),
    _field("zero_optimization.contiguous_gradients", "bool", True, False),
    _field("zero_optimization.reduce_scatter", "bool", True, False),
    _field("zero_optimization.reduce_bucket_size", "int > 0", 500000000, 200000000),
    _field("zero_optimization.use_multi_rank_bucket_allreduce", "bool", True, False),
    _field("zero_optimization.allgather_partitions", "bool", True, False),
    _field("zero_optimization.allgather_bucket_size", "int >= 0", 500000000, 200000000),
    _field("zero_optimization.overlap_comm", "bool|null", None, False, requires=_STAGE3,
           note="null: true at stage 3, false below"),
    _field("zero_optimization.compute_grad_norm", "bool", True, False, requires={"zero_optimization": {"stage": 2}},
           note="false only at stage 1 or 2"),
    _field("zero_optimization.load_from_fp32_weights", "bool", True, False),
    _field("zero_optimization.elastic_checkpoint", "bool", False, True),
    _field("zero_optimization.offload_param", "dict|null", None, {"device": "cpu"}, requires=_STAGE3),
    _field("zero_optimization.offload_optimizer", "dict|null", None, {"device": "cpu"}),
    _field("zero_optimization.zenflow", "dict|null", None, {"topk_ratio": 0.05},
           requires={"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}),
    _field("zero_optimization.sub_group_size", "int >= 0", 1000000000, 100000000),
    _field("zero_optimization.cpu_offload", "bool|null", None, True, requires={"zero_optimization": {"stage": 2}},
           note="deprecated: true becomes offload_optimizer {device: cpu}"),
    _field("zero_optimization.cpu_offload_param", "bool|null", None, True, requires=_STAGE3,
           note="deprecated: true becomes offload_param {device: cpu}"),
    _field("zero_optimization.cpu_offload_use_pin_memory", "bool|null", None, True,
           note="deprecated: only warns (offload_*.pin_memory replaces it)"),
    _field("zero_optimization.stage3_prefetch_bucket_size", "int >= 0", 50000000, 10000000,
           "zero_optimization.prefetch_bucket_size", requires=_STAGE3),
    _field("zero_optimization.stage3_param_persistence_threshold", "int >= 0", 100000, 10000,
           "zero_optimization.param_persistence_threshold", requires=_STAGE3),
    _field("zero_optimization.stage3_model_persistence_threshold", "int >= 0", sys.maxsize, 1000000,
           "zero_optimization.model_persistence_threshold", requires=_STAGE3),
    _field("zero_optimization.stage3_max_live_parameters", "int >= 0", 1000000000, 300000000,
           "zero_optimization.max_live_parameters", requires=_STAGE3),
    _field("zero_optimization.stage3_max_reuse_distance", "int >= 0", 1000000000, 300000000,
           "zero_optimization.max_reuse_distance", requires=_STAGE3),
    _field("zero_optimization.stage3_gather_16bit_weights_on_model_save", "bool", False, True,
           "zero_optimization.gather_16bit_weights_on_model_save",
           "zero_optimization.stage3_gather_fp16_weights_on_model_save", requires=_STAGE3,
           note="stage3_gather_fp16_weights_on_model_save is deprecated"),
    _field("zero_optimization.stage3_module_granularity_threshold", "int", 0, 1000,
           "zero_optimization.module_granularity_threshold", requires=_STAGE3),
    _field("zero_optimization.stage3_use_all_reduce_for_fetch_params", "bool", False, True,
           "zero_optimization.use_all_reduce_for_fetch_params", requires=_STAGE3),
    _field("zero_optimization.stage3_allgather_sequential", "bool", False, True,
           "zero_optimization.allgather_sequential", requires=_STAGE3),
    _field("zero_optimization.ignore_unused_parameters", "bool", True, False),
    _field("zero_optimization.legacy_stage1", "bool", False, True),
    _field("zero_optimization.round_robin_gradients", "bool", False, True),
    _field("zero_optimization.parameter_alignment", "bool", False, True),
    _field("zero_optimization.zero_hpz_partition_size", "int >= 0", 1, 8, requires=_STAGE3),
    _field("zero_optimization.zero_quantized_weights", "bool", False, True, requires=_STAGE3),
    _field("zero_optimization.zero_quantized_nontrainable_weights", "bool", False, True, requires=_STAGE3),
    _field("zero_optimization.zero_quantized_gradients", "bool", False, True, requires=_STAGE3),
    _field("zero_optimization.memory_efficient_linear", "bool", True, False),
    _field("zero_optimization.pipeline_loading_checkpoint", "bool", False, True),
    _field("zero_optimization.override_module_apply", "bool", True, False),
    _field("zero_optimization.log_trace_cache_warnings", "bool", False, True),
    _field("zero_optimization.enable_sanity_checks", "bool", False, True),
    _field("zero_optimization.save_muon_momentum_buffer_in_memory", "bool", False, True),
    # deepspeed/runtime/zero/leaf_module_config.py
    _field("zero_optimization.leaf_module.classes", "list[str]",
           ["transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
            "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
            "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock"],
           ["transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock"]),
    _field("zero_optimization.leaf_module.names", "list[str]", [], ["model.layers.0.mlp"]),
    _field("zero_optimization.leaf_module.name_suffixes", "list[str]", [], ["block_sparse_moe"]),

    # deepspeed/runtime/zero/offload_config.py (DeepSpeedZeroOffloadParamConfig)
    _field("zero_optimization.offload_param.device", "none|cpu|nvme", "none", "cpu", requires=_STAGE3),
    _field("zero_optimization.offload_param.nvme_path", "path|null", None, "/local_nvme", requires=_OFFLOAD_PARAM),
    _field("zero_optimization.offload_param.buffer_count", "int >= 0", 5, 8, requires=_OFFLOAD_PARAM),
    _field("zero_optimization.offload_param.buffer_size", "int >= 0", 100000000, 200000000, requires=_OFFLOAD_PARAM),
    _field("zero_optimization.offload_param.max_in_cpu", "int >= 0", 1000000000, 2000000000,
           requires=_OFFLOAD_PARAM),
    _field("zero_optimization.offload_param.pin_memory", "bool", True, False, requires=_OFFLOAD_PARAM),
    # deepspeed/runtime/zero/offload_config.py (DeepSpeedZeroOffloadOptimizerConfig)
    _field("zero_optimization.offload_optimizer.device", "none|cpu|nvme", "none", "cpu"),
    _field("zero_optimization.offload_optimizer.nvme_path", "path|null", None, "/local_nvme",
           requires=_OFFLOAD_OPTIMIZER),
    _field("zero_optimization.offload_optimizer.buffer_count", "int >= 0", 4, 8, requires=_OFFLOAD_OPTIMIZER),
    _field("zero_optimization.offload_optimizer.pin_memory", "bool", True, False, requires=_OFFLOAD_OPTIMIZER),
    _field("zero_optimization.offload_optimizer.pipeline_read", "bool", False, True, requires=_OFFLOAD_OPTIMIZER),
    _field("zero_optimization.offload_optimizer.pipeline_write", "bool", False, True, requires=_OFFLOAD_OPTIMIZER),
    _field("zero_optimization.offload_optimizer.fast_init", "bool", False, True, requires=_OFFLOAD_OPTIMIZER),
    _field("zero_optimization.offload_optimizer.ratio", "float in [0, 1]", 1.0, 0.3,
           requires={"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}},
           note="below 1 only at stage 3"),
    _field("zero_optimization.offload_optimizer.super_offload", "bool", False, True,
           requires={"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}),
    _field("zero_optimization.offload_optimizer.cpuadam_cores_perc", "float in [0, 1]", 0.8, 0.5,
           requires=_OFFLOAD_OPTIMIZER),
    # deepspeed/runtime/zenflow/zenflow_config.py
    _field("zero_optimization.zenflow.topk_ratio", "float in (0, 1)", 0.1, 0.05, requires=_ZENFLOW),
    _field("zero_optimization.zenflow.select_strategy", "auto|step|epoch", "auto", "step", requires=_ZENFLOW),
    _field("zero_optimization.zenflow.select_interval", "int|auto", "auto", 4, requires=_ZENFLOW),
    _field("zero_optimization.zenflow.update_interval", "int|auto", "auto", 4, requires=_ZENFLOW),
    _field("zero_optimization.zenflow.overlap_step", "bool", False, True, requires=_ZENFLOW),
    _field("zero_optimization.zenflow.offload", "bool", False, True, requires=_ZENFLOW),
    _field("zero_optimization.zenflow.auto_ratio", "float in [0, 1]", 0.99, 0.9, requires=_ZENFLOW),
    _field("zero_optimization.zenflow.full_warm_up_rounds", "int", 0, 2, requires=_ZENFLOW),
    _field("zero_optimization.zenflow.pt_reserved_cores_perc", "float in [0, 1]", 0.5, 0.25, requires=_ZENFLOW),
    _field("zero_optimization.zenflow.steps_per_epoch", "int|null", None, 100, requires=_ZENFLOW),

    # deepspeed/runtime/precision_config.py (DeepSpeedFP16Config)
    _field("fp16.enabled", "bool", False, True),
    _field("fp16.auto_cast", "bool", False, True),
    _field("fp16.loss_scale", "float >= 0", 0.0, 128.0, note="0: dynamic loss scaling"),
    _field("fp16.initial_scale_power", "int", 16, 12),
    _field("fp16.loss_scale_window", "int > 0", 1000, 500, requires={"fp16": {"enabled": True}}),
    _field("fp16.hysteresis", "int", 2, 1),
    _field("fp16.consecutive_hysteresis", "bool", False, True),
    _field("fp16.min_loss_scale", "int > 0", 1, 2),
    _field("fp16.fp16_master_weights_and_grads", "bool", False, True, requires={"zero_optimization": {"stage": 2}}),
    # deepspeed/runtime/precision_config.py (DeepSpeedBF16Config); "bfloat16" is read when "bf16" is absent
    _field("bf16.enabled", "bool", False, True, "bfloat16.enabled"),
    _field("bf16.immediate_grad_update", "bool", False, True, "bfloat16.immediate_grad_update"),
    _field("bf16.check_grad_overflow", "bool", True, False, "bfloat16.check_grad_overflow"),
    _field("bf16.bf16_master_weights_and_grads", "bool", False, True, "bfloat16.bf16_master_weights_and_grads",
           requires={"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}),
    _field("bf16.bf16_optimizer_states", "bool", False, True, "bfloat16.bf16_optimizer_states",
           requires={"zero_optimization": {"stage": 2}, "bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}),
    # deepspeed/runtime/config.py (get_torch_autocast_*)
    _field("torch_autocast.enabled", "bool", False, True),
    _field("torch_autocast.dtype", "dtype name", ABSENT, "bfloat16",
           note="torch.float16, fp16, float16, half, bf16, bfloat16, ..."),
    _field("torch_autocast.lower_precision_safe_modules", "list[str]", ABSENT, ["torch.nn.Linear"]),

    # deepspeed/runtime/activation_checkpointing/config.py
    _field("activation_checkpointing.partition_activations", "bool", False, True),
    _field("activation_checkpointing.contiguous_memory_optimization", "bool", False, True),
    _field("activation_checkpointing.cpu_checkpointing", "bool", False, True),
    _field("activation_checkpointing.number_checkpoints", "int|null", None, 4),
    _field("activation_checkpointing.synchronize_checkpoint_boundary", "bool", False, True),
    _field("activation_checkpointing.profile", "bool", False, True),

    # deepspeed/runtime/swap_tensor/aio_config.py, swap_tensor/constants.py
    _field("aio.block_size", "int", 1048576, 262144),
    _field("aio.queue_depth", "int", 8, 32),
    _field("aio.intra_op_parallelism", "int", 1, 4,
           note="the docs' thread_count is not read by 0.19.8 (ignored)"),
    _field("aio.single_submit", "bool", False, True),
    _field("aio.overlap_events", "bool", True, False),
    _field("aio.use_gds", "bool", False, True, note="true asserts a CUDA accelerator"),

    # deepspeed/comm/config.py, comm/constants.py
    _field("comms_logger.enabled", "bool", False, True),
    _field("comms_logger.prof_all", "bool", True, False),
    _field("comms_logger.prof_ops", "list[str]", [], ["all_reduce", "all_gather"]),
    _field("comms_logger.verbose", "bool", False, True),
    _field("comms_logger.debug", "bool", False, True),

    # deepspeed/monitor/config.py
    _field("tensorboard.enabled", "bool", False, True),
    _field("tensorboard.output_path", "str", "", "output/ds_logs/"),
    _field("tensorboard.job_name", "str", "DeepSpeedJobName", "train_gpt"),
    _field("wandb.enabled", "bool", False, True),
    _field("wandb.group", "str|null", None, "my_group"),
    _field("wandb.team", "str|null", None, "my_team"),
    _field("wandb.project", "str", "deepspeed", "my_project"),
    _field("csv_monitor.enabled", "bool", False, True),
    _field("csv_monitor.output_path", "str", "", "output/csv/"),
    _field("csv_monitor.job_name", "str", "DeepSpeedJobName", "train_gpt"),
    _field("comet.enabled", "bool", False, True),
    _field("comet.samples_log_interval", "int", 100, 50),
    _field("comet.project", "str|null", None, "my_project"),
    _field("comet.workspace", "str|null", None, "my_workspace"),
    _field("comet.api_key", "str|null", None, "0123456789abcdef"),
    _field("comet.experiment_name", "str|null", None, "llama-fine-tuning"),
    _field("comet.experiment_key", "str|null", None, "0c4a1c4a90664f2a8084e600b19a9d7"),
    _field("comet.online", "bool|null", None, False),
    _field("comet.mode", "str|null", None, "get"),

    # deepspeed/profiling/config.py, profiling/constants.py
    _field("flops_profiler.enabled", "bool", False, True),
    _field("flops_profiler.recompute_fwd_factor", "float", 0.0, 1.0),
    _field("flops_profiler.profile_step", "int", 1, 10),
    _field("flops_profiler.module_depth", "int", -1, 2),
    _field("flops_profiler.top_modules", "int", 1, 3),
    _field("flops_profiler.detailed", "bool", True, False),
    _field("flops_profiler.output_file", "str|null", None, "flops.txt"),

    # deepspeed/autotuning/config.py, autotuning/constants.py
    _field("autotuning.enabled", "bool", False, True),
    _field("autotuning.fast", "bool", True, False),
    _field("autotuning.results_dir", "str", "autotuning_results", "my_results"),
    _field("autotuning.exps_dir", "str", "autotuning_exps", "my_exps"),
    _field("autotuning.overwrite", "bool", True, False),
    _field("autotuning.start_profile_step", "int", 3, 5),
    _field("autotuning.end_profile_step", "int", 5, 10),
    _field("autotuning.metric", "latency|throughput|flops", "throughput", "latency"),
    _field("autotuning.metric_path", "str|null", None, "metrics.json"),
    _field("autotuning.tuner_type", "gridsearch|random|model_based", "gridsearch", "model_based"),
    _field("autotuning.tuner_early_stopping", "int", 5, 10),
    _field("autotuning.tuner_num_trials", "int", 50, 20),
    _field("autotuning.arg_mappings", "dict|null", None,
           {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size"}),
    _field("autotuning.model_info", "dict|null", None, {"profile": True}),
    _field("autotuning.model_info_path", "str|null", None, "model_info.json"),
    _field("autotuning.mp_size", "int", 1, 2),
    _field("autotuning.max_train_batch_size", "int|null", None, 64),
    _field("autotuning.min_train_batch_size", "int", 1, 2),
    _field("autotuning.max_train_micro_batch_size_per_gpu", "int", 1024, 32),
    _field("autotuning.min_train_micro_batch_size_per_gpu", "int", 1, 2),
    _field("autotuning.num_tuning_micro_batch_sizes", "int", 3, 5),

    # deepspeed/runtime/config.py (checkpoint), runtime/model_checkpointing/config.py, constants.py
    _field("checkpoint.tag_validation", "Warn|Ignore|Fail", "Warn", "Fail", note="case-insensitive"),
    _field("checkpoint.load_universal", "bool", False, True),
    _field("checkpoint.use_node_local_storage", "bool", False, True),
    _field("checkpoint.parallel_write.pipeline_stage", "bool", False, True),
    _field("checkpoint.checkpoint_serialization", "bool", True, False),
    _field("checkpoint.writer", "dict|null", None, {"type": "fast"}),
    _field("checkpoint.writer.type", "mock|python|fast", "fast", "python", requires={"checkpoint": {"writer": {}}},
           note="case-insensitive"),
    _field("checkpoint.writer.io_buffer_size", "int", 67108864, 16777216, requires={"checkpoint": {"writer": {}}}),
    _field("checkpoint.writer.io_buffer_double", "bool", True, False, requires={"checkpoint": {"writer": {}}}),
    _field("checkpoint.writer.show_statistics", "bool", False, True, requires={"checkpoint": {"writer": {}}}),
    _field("checkpoint.writer.data_parallel", "replica|socket|machine|null", None, "socket",
           requires={"checkpoint": {"writer": {}}}),
    _field("checkpoint.writer.decoupled", "bool", False, True, requires={"checkpoint": {"writer": {}}}),
    _field("checkpoint.writer.io_multiplier", "int", 1, 2, requires={"checkpoint": {"writer": {}}}),

    # deepspeed/runtime/config.py (data_types), runtime/constants.py
    _field("data_types.grad_accum_dtype", "fp32|fp16|bf16|null", None, "fp32"),
    _field("data_types.param_dtype", "fp32|fp16|bf16|null", None, "bf16"),
    _field("data_types.buffer_dtype", "fp32|fp16|bf16|null", None, "fp32"),
    _field("data_types.keep_in_fp32_modules", "auto|list[str]", "auto", ["lm_head"]),

    # deepspeed/runtime/config.py (get_pipeline_config)
    _field("pipeline.stages", "int|auto", "auto", 2),
    _field("pipeline.partition", "str", "best", "uniform"),
    _field("pipeline.seed_layers", "bool", False, True),
    _field("pipeline.activation_checkpoint_interval", "int", 0, 1),
    _field("pipeline.pipe_partitioned", "bool", True, False),
    _field("pipeline.grad_partitioned", "bool", True, False),

    # deepspeed/runtime/config.py (HybridEngineConfig)
    _field("hybrid_engine.enabled", "bool", False, True),
    _field("hybrid_engine.max_out_tokens", "int > 0", 512, 1024),
    _field("hybrid_engine.inference_tp_size", "int", 1, 2),
    _field("hybrid_engine.release_inference_cache", "bool", False, True),
    _field("hybrid_engine.pin_parameters", "bool", True, False),
    _field("hybrid_engine.tp_gather_partition_size", "int", 8, 4),
    _field("hybrid_engine.enable_cuda_graph", "bool", False, True),

    # deepspeed/compile/config.py (CompileConfig)
    _field("compile.deepcompile", "bool", False, True),
    _field("compile.autoep_non_moe", "bool", False, True),
    _field("compile.free_activation", "bool", False, True),
    _field("compile.free_activation_threshold", "int", 10485760, 1048576),
    _field("compile.offload_activation", "bool", False, True),
    _field("compile.offload_activation_pin_memory", "bool", True, False),
    _field("compile.offload_opt_states", "bool", False, True),
    _field("compile.double_buffer", "bool", True, False),
    _field("compile.symmetric_memory", "bool", False, True),
    _field("compile.debug_log", "bool", False, True),
    _field("compile.offload_parameters", "bool", False, True),
    _field("compile.sync_before_reduce", "bool", False, True),
    _field("compile.sync_after_reduce", "bool", False, True),
    _field("compile.sync_before_allgather", "bool", False, True),
    _field("compile.sync_after_allgather", "bool", False, True),
    _field("compile.keep_int_input_tensors", "bool", True, False),
    _field("compile.keep_all_input_tensors", "bool", False, True),
    _field("compile.passes", "list[z1|z3|autosp|autotp]|null", None, ["z3"]),

    # deepspeed/utils/config.py (DeepSpeedThroughputTimerConfig)
    _field("timers.throughput.enabled", "bool", True, False),
    _field("timers.throughput.synchronized", "bool", True, False),

    # deepspeed/runtime/tensor_parallel/config.py (TPTrainingConfig, TPConfig)
    _field("tensor_parallel.autotp_size", "int", 0, 2),
    _field("tensor_parallel.tp_overlap_comm", "bool", False, True),
    _field("tensor_parallel.vocab_parallel_lm_head", "bool|null", None, True),
    _field("tensor_parallel.vocab_parallel_ce_backend", "torch|liger", "torch", "liger"),
    _field("tensor_parallel.partition_config", "dict|null", None, {"use_default_specs": False, "layer_specs": []}),
    _field("tensor_parallel.preset_model", "str|null", None, "llama"),
    _field("tensor_parallel.keep_module_on_host", "bool", False, True),
    _field("tensor_parallel.replace_with_kernel_inject", "bool", False, True, "tensor_parallel.kernel_inject"),
    _field("tensor_parallel.tp.tp_size", "int", 1, 2, "tensor_parallel.tensor_parallel.tp_size"),
    _field("tensor_parallel.tp.tp_grain_size", "int", 1, 64, "tensor_parallel.tensor_parallel.tp_grain_size"),

    # deepspeed/inference/config.py (WeightQuantConfig); the section is read only when present
    _field("weight_quantization", "dict", ABSENT, {"enabled": True}),
    _field("weight_quantization.enabled", "bool", True, False, requires={"weight_quantization": {}}),
    _field("weight_quantization.num_bits", "int", 8, 4, requires={"weight_quantization": {}}),
    _field("weight_quantization.q_type", "symmetric|asymmetric", "symmetric", "asymmetric",
           requires={"weight_quantization": {}}),
    _field("weight_quantization.q_groups", "int", 1, 64, requires={"weight_quantization": {}}),
    _field("weight_quantization.quantized_initialization", "dict", {}, {"num_bits": 8},
           requires={"weight_quantization": {}}),
    _field("weight_quantization.post_init_quant", "dict", {}, {"fc": {"num_bits": 4}},
           requires={"weight_quantization": {}}),

    # deepspeed/module_inject/auto_ep_config.py (parse_autoep_config); read only when present
    _field("expert_parallel.enabled", "bool", False, True),
    _field("expert_parallel.autoep_size", "int", 1, 2, requires=_EXPERT_PARALLEL),
    _field("expert_parallel.expert_tensor_parallel_size", "int", 1, 2, requires=_EXPERT_PARALLEL),
    _field("expert_parallel.preset_model", "str|null", None, "mixtral", requires=_EXPERT_PARALLEL),
    _field("expert_parallel.moe_layer_pattern", "str|null", None, "model\\.layers\\.\\d+\\.moe",
           requires=_EXPERT_PARALLEL),
    _field("expert_parallel.router_pattern", "str|null", None, "router", requires=_EXPERT_PARALLEL),
    _field("expert_parallel.expert_pattern", "str|null", None, "mlp_experts", requires=_EXPERT_PARALLEL),
    _field("expert_parallel.use_grouped_mm", "bool", True, False, requires=_EXPERT_PARALLEL),

    # deepspeed/runtime/data_pipeline/config.py, data_pipeline/constants.py
    _field("data_efficiency.enabled", "bool", False, True),
    _field("data_efficiency.seed", "int", 1234, 42),
    _field("data_efficiency.data_sampling.enabled", "bool", False, True),
    _field("data_efficiency.data_sampling.num_epochs", "int", 1000, 1),
    _field("data_efficiency.data_sampling.num_workers", "int", 0, 2),
    _field("data_efficiency.data_sampling.pin_memory", "bool", False, True),
    _field("data_efficiency.data_sampling.curriculum_learning", "dict", {}, {
        "enabled": True, "data_cluster_path": "/path/to/data_clusters", "curriculum_metrics": {"vocabularyrarity": {
            "index_to_sample_path": "/path/to/index_to_sample", "index_to_metric_path": "/path/to/index_to_metric",
            "difficulty_type": "percentile", "clustering_type": "schedule_based", "min_difficulty": 1,
            "max_difficulty": 100, "schedule_type": "fixed_root",
            "schedule_config": {"total_curriculum_step": 110000, "difficulty_step": 1, "root_degree": 2}}}},
           note="its keys are read only when enabled"),
    _field("data_efficiency.data_sampling.dynamic_batching.enabled", "bool", False, True,
           requires={"data_efficiency": {"data_sampling": {"dynamic_batching": {"max_tokens": 2048}}}}),
    _field("data_efficiency.data_sampling.dynamic_batching.max_tokens", "int", ABSENT, 2048,
           note="required when enabled"),
    _field("data_efficiency.data_sampling.dynamic_batching.metrics_path", "str", ABSENT, "/path/to/seqlen_metric",
           note="kept as given"),
    _field("data_efficiency.data_sampling.dynamic_batching.lr_scaling_method", "linear|sqrt|none", "linear", "sqrt"),
    _field("data_efficiency.data_sampling.dynamic_batching.min_batch_size", "int", 1, 2),
    _field("data_efficiency.data_sampling.dynamic_batching.max_batch_size", "int", ABSENT, 16,
           note="absent: no limit (null is refused)"),
    _field("data_efficiency.data_sampling.dynamic_batching.sequence_picking_order", "dataloader|random|seqlen",
           "dataloader", "random"),
    _field("data_efficiency.data_sampling.dynamic_batching.verbose", "bool", False, True),
    _field("data_efficiency.data_routing.enabled", "bool", False, True),
    _field("data_efficiency.data_routing.random_ltd", "dict", {}, {
        "enabled": True, "total_layer_num": 24, "random_ltd_layer_num": 22, "model_mask_name": "attention_mask",
        "model_type": "decoder", "hidden_state_order": "seq_batch_dim"},
           note="its keys are read only when enabled"),

    # deepspeed/datastates/config.py: any value but false turns DataStates checkpointing on
    _field("datastates_ckpt", "dict|false", ABSENT, {"host_cache_size": 16}),
]


class Coercion(NamedTuple):
    path: str
    given: Any  # the JSON value
    reads_as: Any  # the plain value DeepSpeed parses it to; OMITTED or REFUSED
    note: str = ""


# Each checked by deepspeed_config_fields_check.py: the given value parses to
# the same config as ``reads_as`` (as leaving the key out for OMITTED), or
# DeepSpeedConfig raises (REFUSED).
COERCIONS: list[Coercion] = [
    # bool fields of the pydantic sections: pydantic's lax bool
    Coercion("zero_optimization.overlap_comm", 1, True),
    Coercion("zero_optimization.overlap_comm", 0, False),
    Coercion("zero_optimization.overlap_comm", 1.0, True),
    Coercion("zero_optimization.overlap_comm", "true", True),
    Coercion("zero_optimization.overlap_comm", "yes", True),
    Coercion("zero_optimization.overlap_comm", "off", False),
    Coercion("zero_optimization.overlap_comm", 2, REFUSED),
    Coercion("zero_optimization.contiguous_gradients", None, REFUSED, "null only where the type says so"),
    Coercion("tensorboard.enabled", 1, True),
    # int fields: a float without a fraction, a decimal string, a bool
    Coercion("zero_optimization.reduce_bucket_size", 5e8, 500000000, "JSON 5e8 is a float"),
    Coercion("zero_optimization.stage3_max_live_parameters", 1e9, 1000000000),
    Coercion("zero_optimization.reduce_bucket_size", "500000000", 500000000),
    Coercion("zero_optimization.reduce_bucket_size", "5e8", REFUSED, "a string in exponent notation"),
    Coercion("zero_optimization.reduce_bucket_size", "1e9", REFUSED),
    Coercion("zero_optimization.reduce_bucket_size", 2.5, REFUSED, "a fraction"),
    Coercion("zero_optimization.reduce_bucket_size", 1e20, REFUSED, "beyond int64"),
    Coercion("zero_optimization.reduce_bucket_size", True, 1),
    Coercion("zero_optimization.reduce_bucket_size", 0, REFUSED, "must be > 0"),
    Coercion("zero_optimization.sub_group_size", 0, 0, "legal (>= 0), as Axolotl's ZeRO-3 templates set it"),
    Coercion("zero_optimization.stage3_max_live_parameters", 0, 0, "legal (>= 0)"),
    Coercion("zero_optimization.stage", "3", 3),
    Coercion("zero_optimization.stage", 3.0, 3),
    Coercion("zero_optimization.stage", 4, REFUSED),
    Coercion("fp16.initial_scale_power", 16.0, 16),
    Coercion("fp16.initial_scale_power", 16.5, REFUSED),
    Coercion("fp16.min_loss_scale", True, REFUSED, "fp16's own validator refuses bools"),
    Coercion("fp16.loss_scale", "128", 128.0),
    # "auto" in a pydantic section: the key is dropped before validation
    Coercion("zero_optimization.reduce_bucket_size", "auto", OMITTED),
    Coercion("zero_optimization.stage3_prefetch_bucket_size", "auto", OMITTED),
    Coercion("zero_optimization.stage3_param_persistence_threshold", "auto", OMITTED),
    Coercion("zero_optimization.stage3_gather_16bit_weights_on_model_save", "auto", OMITTED),
    Coercion("zero_optimization.stage", "auto", OMITTED, "stage 0"),
    Coercion("zero_optimization.offload_optimizer.device", "auto", OMITTED, "device none"),
    Coercion("fp16.enabled", "auto", OMITTED),
    Coercion("bf16.enabled", "auto", OMITTED),
    # enums are exact
    Coercion("zero_optimization.offload_optimizer.device", "CPU", REFUSED),
    # top-level keys are plain lookups: kept as given, "auto" is not resolved
    Coercion("train_batch_size", "auto", REFUSED, "TypeError: transformers replaces it before DeepSpeed"),
    Coercion("train_micro_batch_size_per_gpu", "auto", REFUSED),
    Coercion("gradient_accumulation_steps", "auto", REFUSED),
    Coercion("gradient_accumulation_steps", "2", REFUSED),
    Coercion("gradient_accumulation_steps", 2.0, 2, "kept as the float 2.0"),
    Coercion("gradient_clipping", "auto", "auto", "kept as the string; the engine would fail on it"),
    Coercion("steps_per_print", float("inf"), float("inf"), "what Accelerate's DeepSpeedPlugin sets"),
    Coercion("communication_data_type", "FP32", "fp32"),
    Coercion("communication_data_type", "auto", REFUSED),
    Coercion("monitor_config", {"enabled": True}, OMITTED, "an unknown top-level key is ignored"),
    Coercion("comms_config", {"verbose": False}, OMITTED, "an unknown top-level key is ignored"),
    Coercion("aio.thread_count", 1, OMITTED, "an unknown key in a get_scalar_param section is ignored"),
    # an unknown key inside a pydantic section is an error
    Coercion("zero_optimization.aio", {"block_size": 262144}, REFUSED,
             "the transformers docs' ZeRO-Infinity example puts aio here"),
    Coercion("compile.disable", False, REFUSED, "Axolotl's torch_compile templates"),
    Coercion("compile.backend", "inductor", REFUSED),
]


# deepspeed/runtime/config.py _REMOVED_TOP_LEVEL_CONFIG_KEYS, _REMOVED_ZERO_CONFIG_KEYS:
# DeepSpeedConfig raises DeepSpeedConfigError on any of these.
REMOVED: list[str] = [
    "nebula", "compression_training", "amp", "quantize_training", "sparse_gradients", "eigenvalue",
    "sparse_attention", "elasticity", "graph_harvesting", "curriculum_learning", "progressive_layer_drop",
    "zero_optimization.mics_shard_size", "zero_optimization.mics_hierarchical_params_gather",
    "zero_optimization.zeropp_loco_param",
]
