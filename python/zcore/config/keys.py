"""DeepSpeed's config keys that zcore does not hold under its own name, and
their fate.

A DeepSpeed user keeps their config. DeepSpeed 0.19.8 reads more keys than
zcore's schema has; each of them is one of:

- an alias: another name DeepSpeed takes for a key zcore honours
  (``prefetch_bucket_size`` for ``stage3_prefetch_bucket_size``, ...);
- a tuning choice zcore makes itself (``overlap_comm``, ``sub_group_size: 0``,
  ...): accepted whatever its value, and listed once by ``zcore.initialize``
  with what zcore does instead;
- unsupported: accepted only at a value that changes nothing (the second
  column), refused otherwise with the reason, since zcore would compute or
  save something else than the user asked for.

A top-level key DeepSpeed does not know either, DeepSpeed ignores; so does
zcore, with a warning naming it (``Translation.ignored``).
"""

from __future__ import annotations

import json
import reprlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from zcore.config.section import boolean_of, number_in_string

_ANY = object()  # refused whatever the value


@dataclass(frozen=True)
class _Off:
    """A section accepted while its switch ``key`` is absent or one of ``off``."""

    key: str
    off: tuple[Any, ...]

    def __str__(self) -> str:
        return " or ".join(f'`"{self.key}": {json.dumps(value)}`' for value in self.off)


_DISABLED = _Off("enabled", (False,))


@dataclass(frozen=True)
class _OneOf:
    """A key accepted at any of ``values`` (each compared as a default is)."""

    values: tuple[Any, ...]

    def __str__(self) -> str:
        return " or ".join(f"`{json.dumps(value)}`" for value in self.values)

# DeepSpeed's other names for zcore's keys (DeepSpeed's pydantic aliases,
# and its deprecated names that it reads as the new one).
ALIASES: dict[str, str] = {
    "zero_optimization.prefetch_bucket_size": "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.param_persistence_threshold": "zero_optimization.stage3_param_persistence_threshold",
    "zero_optimization.max_live_parameters": "zero_optimization.stage3_max_live_parameters",
    "zero_optimization.max_reuse_distance": "zero_optimization.stage3_max_reuse_distance",
    "zero_optimization.gather_16bit_weights_on_model_save":
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    "zero_optimization.stage3_gather_fp16_weights_on_model_save":
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    "bfloat16": "bf16",
}

# DeepSpeed's deprecated switches that stand for an offload section: true
# gives the section with device "cpu".
OFFLOAD_SWITCHES: dict[str, str] = {
    "zero_optimization.cpu_offload": "zero_optimization.offload_optimizer",
    "zero_optimization.cpu_offload_param": "zero_optimization.offload_param",
}

# Tuning choices: the key, the JSON type DeepSpeed takes for it ("bool",
# "int", "float", "str", "section" or "any"), and what zcore does instead.
TUNING_KEYS: dict[str, tuple[str, str]] = {
    "zero_optimization.overlap_comm": ("bool", "zcore always overlaps gradient reduction with backward"),
    "zero_optimization.contiguous_gradients": ("bool", "zcore always reduces from contiguous unit buffers"),
    "zero_optimization.reduce_scatter": ("bool", "zcore always reduce-scatters gradients"),
    "zero_optimization.allgather_partitions": ("bool", "zcore always all-gathers whole units"),
    "zero_optimization.use_multi_rank_bucket_allreduce": ("bool", "zcore reduce-scatters each bucket once"),
    "zero_optimization.round_robin_gradients": (
        "bool", "zcore's bucket layout gives each rank an equal share without it"),
    "zero_optimization.ignore_unused_parameters": (
        "bool", "zcore always trains with parameters that get no gradient (their shards keep their values)"),
    "zero_optimization.load_from_fp32_weights": ("bool", "zcore's checkpoints always restore the fp32 master weights"),
    "zero_optimization.elastic_checkpoint": ("bool", "zcore's checkpoints reload at any world size"),
    "zero_optimization.legacy_stage1": ("bool", "zcore has one stage 1"),
    "zero_optimization.parameter_alignment": ("bool", "zcore aligns its flat buffers itself"),
    "zero_optimization.cpu_offload_use_pin_memory": ("bool", "use offload_optimizer/offload_param.pin_memory"),
    "zero_optimization.stage3_model_persistence_threshold": (
        "int", "zcore keeps whole only parameters under stage3_param_persistence_threshold"),
    "zero_optimization.model_persistence_threshold": (
        "int", "zcore keeps whole only parameters under stage3_param_persistence_threshold"),
    "zero_optimization.stage3_module_granularity_threshold": ("int", "zcore gathers by its own units"),
    "zero_optimization.module_granularity_threshold": ("int", "zcore gathers by its own units"),
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": ("bool", "zcore all-gathers parameters"),
    "zero_optimization.use_all_reduce_for_fetch_params": ("bool", "zcore all-gathers parameters"),
    "zero_optimization.stage3_allgather_sequential": ("bool", "zcore all-gathers whole units"),
    "zero_optimization.allgather_sequential": ("bool", "zcore all-gathers whole units"),
    "zero_optimization.memory_efficient_linear": ("bool", "zcore's stage 3 needs no special linear layer"),
    "zero_optimization.pipeline_loading_checkpoint": ("bool", "zcore loads checkpoints shard by shard"),
    "zero_optimization.override_module_apply": ("bool", "zcore gathers for module.apply through GatheredParameters"),
    "zero_optimization.log_trace_cache_warnings": ("bool", "zcore checks its traces itself"),
    "zero_optimization.compute_grad_norm": (
        "bool", "zcore computes the gradient norm where clipping or a monitor needs it"),
    "zero_optimization.enable_sanity_checks": (
        "bool", "zcore checks that ranks agree (stage3_rank_agreement_check: every_module checks at every module)"),
    "zero_optimization.save_muon_momentum_buffer_in_memory": ("bool", "zcore keeps optimizer states as it offloads them"),
    "zero_optimization.offload_optimizer.ratio": ("float", "zcore offloads all optimizer states"),
    "zero_optimization.offload_optimizer.super_offload": ("bool", "zcore steps offloaded states with its CPU Adam"),
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": ("float", "zcore's CPU Adam uses torch's threads"),
    "zero_force_ds_cpu_optimizer": (
        "bool", "zcore picks the optimizer that runs on the CPU itself (its fused CPU Adam for Adam and AdamW)"),
    "prescale_gradients": ("bool", "zcore averages gradients in one reduction; the result is the same"),
    "gradient_predivide_factor": ("float", "zcore averages gradients in one reduction; the result is the same"),
    "disable_allgather": ("bool", "zcore's collectives are its own"),
    "vocabulary_size": ("any", "DeepSpeed only warns with it; zcore takes the model as it is"),
    "allgather_size": ("int", "DeepSpeed reads it only with \"zero_optimization\": true; so does zcore"),
    "datastates_ckpt": ("any", "zcore writes checkpoints with its own writer"),
    "disable_python_gc": ("any", "zcore leaves Python's garbage collector to the user"),
    "managed_gradient_accumulation": ("bool", "zcore's engine.backward and step count the accumulation"),
    "log_level": ("any", "zcore logs through the logging module's 'zcore' logger"),
    "memory_breakdown": ("bool", "use engine.memory_report()"),
    "dump_state": ("bool", "use engine.memory_report() and the step metrics"),
    "comms_logger": ("section", "zcore's step metrics time collective waits (wall_clock_breakdown or a monitor)"),
    "timers": ("section", "zcore's step metrics time each step (wall_clock_breakdown)"),
    "autotuning": ("section", "zcore estimates memory itself (zcore estimate)"),
    "comet": ("section", "zcore's monitors are tensorboard, csv_monitor and wandb"),
    "compile": ("section", "zcore does not run DeepSpeed's compiler passes"),
    "datastates": ("section", "zcore writes checkpoints with its own writer"),
    "seq_parallel_communication_data_type": ("any", "zcore has no sequence parallelism of its own"),
    "use_data_before_expert_parallelism": ("bool", "zcore has no expert parallelism of its own"),
    "optimizer.legacy_fusion": ("bool", "zcore fuses its optimizer steps itself"),
    "aio.single_submit": ("bool", "zcore's I/O engine always submits a request's blocks as one batch"),
    "aio.overlap_events": ("bool", "zcore's I/O engine always overlaps submission with completion"),
    "aio.use_gds": ("bool", "zcore reads and writes NVMe through pinned host memory"),
    "aio.thread_count": ("int", "DeepSpeed 0.19.8 no longer reads it; zcore's I/O threads are aio.intra_op_parallelism"),
    "bf16.immediate_grad_update": ("bool", "zcore accumulates gradients in fp32 and steps at the boundary"),
    "checkpoint.load_universal": ("bool", "zcore checkpoints reload at any world size as they are"),
    "checkpoint.use_node_local_storage": ("bool", "every rank writes to the one checkpoint directory"),
    "checkpoint.parallel_write": (
        "section", "each rank of every pipeline stage writes its own shards of one checkpoint already"),
    "checkpoint.checkpoint_serialization": ("any", "zcore writes its own tensor files"),
    "checkpoint.writer": (
        "section", "zcore writes checkpoints with its own writer (in the background: checkpoint.async_save)"),
    "activation_checkpointing": (
        "section",
        "these keys configure deepspeed.checkpointing.checkpoint, which zcore.checkpointing gives "
        "(zcore.checkpointing.configure(None, deepspeed_config=...) reads them); models that checkpoint with "
        "torch.utils.checkpoint need none of them"),
    "pipeline": (
        "section",
        "the section configures DeepSpeed's PipelineModule; zcore pipelines through zcore.pipelining's "
        "PipelineStage and a device_mesh with a \"pp\" dimension (docs/guide/parallelism.md)"),
}

# Keys zcore cannot honour: the value that changes nothing (accepted, and
# dropped), and why any other is refused.
UNSUPPORTED_KEYS: dict[str, tuple[Any, str]] = {
    "zero_optimization.zero_quantized_nontrainable_weights": (
        False,
        "storing frozen weights quantized is not supported; zero_quantized_weights quantizes their all-gathers",
    ),
    "zero_optimization.zenflow": (None, "ZenFlow's stale-gradient updates are not supported"),
    "fp16.auto_cast": (False, "zcore casts the model to fp16 itself; torch autocast inside it is not supported"),
    "fp16.fp16_master_weights_and_grads": (False, "zcore keeps master weights and gradients in fp32"),
    "data_types.grad_accum_dtype": (_OneOf((None, "fp32")), "zcore accumulates gradients in fp32"),
    "data_types.param_dtype": (None, "zcore's parameters take the compute dtype of bf16 or fp16"),
    "data_types.buffer_dtype": (None, "zcore's buffers keep their dtype unless bf16/fp16.cast_buffers"),
    "data_types.keep_in_fp32_modules": ("auto", "zcore keeps no modules in fp32 by name"),
    "gradient_allreduce_op": ("mean", "zcore averages gradients over the ranks"),
    "torch_autocast": (_DISABLED, "torch autocast inside the engine is not supported; use bf16 or fp16"),
    "amp": (_DISABLED, "use bf16.enabled or fp16.enabled (zcore's own mixed precision)"),
    "sparse_gradients": (False, "sparse gradients are not supported"),
    "hybrid_engine": (_DISABLED, "DeepSpeed's hybrid (RLHF) engine is not supported"),
    "elasticity": (_DISABLED, "elastic batch sizes are not supported"),
    "data_efficiency": (_DISABLED, "not supported"),
    "curriculum_learning": (_DISABLED, "not supported"),
    "compression_training": (_ANY, "not supported"),
    "sparse_attention": (_ANY, "not supported"),
    "weight_quantization": (_ANY, "not supported"),
    "tensor_parallel": (
        _Off("autotp_size", (0, 1)), "zcore composes with torch's tensor parallelism through a device_mesh with a \"tp\" dimension "
              "(docs/guide/parallelism.md), not DeepSpeed's AutoTP"),
    "expert_parallel": (_DISABLED, "expert parallelism is not supported"),
    "sequence_parallel_size": (
        1, "zcore has no sequence parallelism: every rank is a data-parallel rank, so the batch sizes would "
           "differ from DeepSpeed's"),
}

# The sections DeepSpeed reads with its pydantic models, which take "auto"
# as the key's default (DeepSpeedConfigModel drops it).
AUTO_AS_DEFAULT = (
    "zero_optimization", "zero_optimization.offload_optimizer", "zero_optimization.offload_param", "fp16", "bf16",
)


@dataclass
class Translation:
    """A DeepSpeed config in zcore's keys (``config``), with what became of
    the others: ``renamed`` (the aliases used), ``decided`` (one line per tuning key: the key and what zcore
    does), ``ignored`` (top-level keys DeepSpeed does not read either) and
    ``problems`` (one refusal per line)."""

    config: dict
    renamed: dict[str, str] = field(default_factory=dict)  # zcore's key: the alias the config used
    decided: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def translate(raw: dict, top_level: Iterable[str]) -> Translation:
    """``raw`` (left as it was) in zcore's keys; ``top_level``: the keys of
    zcore's schema, beside which every top-level key this module knows is
    DeepSpeed's."""
    result = Translation(dict(raw))
    _drop_untyped_sections(result)
    _read_zero_switch(result)
    _rename_aliases(result)
    _switch_offload(result)
    _drop_auto(result)
    _drop_param_offload_below_stage_3(result)
    _take_tuning_keys(result)
    _drop_unsupported(result)
    known = set(top_level) | {key.split(".")[0] for key in (*TUNING_KEYS, *UNSUPPORTED_KEYS, *ALIASES)}
    result.ignored = [key for key in result.config if key not in known]
    for key in result.ignored:
        del result.config[key]
    return result


def _drop_untyped_sections(result: Translation) -> None:
    """An optimizer or scheduler section whose type is null configures
    none, as in DeepSpeed (its default type is null)."""
    for key in ("optimizer", "scheduler"):
        section = result.config.get(key)
        if isinstance(section, dict) and "type" in section and section["type"] is None:
            del result.config[key]
            result.decided.append(f"{key}.type = null (no {key} from the config, as in DeepSpeed)")


def _read_zero_switch(result: Translation) -> None:
    """DeepSpeed's oldest form, ``"zero_optimization": true``: stage 1 (0
    for false), with the all-gather bucket from the top-level
    ``allgather_size``, as DeepSpeed 0.19.8 still reads it."""
    switch = result.config.get("zero_optimization")
    if not isinstance(switch, bool):
        return
    zero: dict[str, Any] = {"stage": 1 if switch else 0}
    if switch:
        zero["allgather_bucket_size"] = result.config.get("allgather_size", 500_000_000)
    result.config.pop("allgather_size", None)
    result.config["zero_optimization"] = zero
    result.decided.append(f"zero_optimization = {str(switch).lower()} (DeepSpeed's deprecated form: read as stage "
                          f"{zero['stage']})")


def _rename_aliases(result: Translation) -> None:
    for alias, target in ALIASES.items():
        found, value = _pop(result.config, alias)
        if not found:
            continue
        present, existing = _get(result.config, target)
        if present and not _same_value(existing, value):
            result.problems.append(
                f"config keys {alias!r} = {show_value(value)} and {target!r} = {show_value(existing)} name "
                f"the same setting (DeepSpeed takes both names); keep one"
            )
            continue
        _put(result.config, target, value)
        result.renamed[target] = alias


def _same_value(a: Any, b: Any) -> bool:
    # Python has True == 1: a boolean is the same value only as itself.
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return bool(a == b)


def _switch_offload(result: Translation) -> None:
    for switch, section in OFFLOAD_SWITCHES.items():
        found, value = _pop(result.config, switch)
        if not found:
            continue
        problem = kind_problem(value, "bool")
        if problem is not None:
            result.problems.append(f"{switch}: {problem} (got {show_value(value)})")
        elif value is not None and as_bool(value):
            if _get(result.config, section)[0]:
                result.problems.append(
                    f"config keys {switch!r} (DeepSpeed's deprecated switch) and {section!r} both offload; "
                    f"keep {section!r}"
                )
            else:
                _put(result.config, section, {"device": "cpu"})
                result.decided.append(f"{switch} (DeepSpeed's deprecated name: read as {section}.device = 'cpu')")


def _drop_param_offload_below_stage_3(result: Translation) -> None:
    """DeepSpeed reads offload_param at stage 3 only and ignores it below (a
    template whose stage was lowered keeps it): so does zcore, saying so."""
    found, section = _get(result.config, "zero_optimization.offload_param")
    device = section.get("device", "none") if isinstance(section, dict) else "none"
    if not found or not isinstance(device, str) or device.lower() == "none":
        return
    stage_found, stage = _get(result.config, "zero_optimization.stage")
    if stage_found and kind_problem(stage, "int") is not None:
        return  # the schema names the bad stage
    stage = as_number(stage) if stage_found else 0
    if stage in (0, 1, 2):  # stage 3 reads it; the schema refuses any other
        stage = int(stage)
        _pop(result.config, "zero_optimization.offload_param")
        result.decided.append(
            f"zero_optimization.offload_param (device {device!r}: read at stage 3 only, so ignored at stage "
            f"{stage}, as DeepSpeed ignores it; parameters stay on the device)"
        )


def _drop_auto(result: Translation) -> None:
    for path in AUTO_AS_DEFAULT:
        section = _get(result.config, path)[1]
        if not isinstance(section, dict):
            continue
        for key in [k for k, v in section.items() if isinstance(v, str) and v == "auto"]:
            _pop(result.config, f"{path}.{key}")
            result.decided.append(f'{path}.{key} = "auto" (DeepSpeed takes it as the default; so does zcore)')


def _take_tuning_keys(result: Translation) -> None:
    for dotted, (kind, instead) in TUNING_KEYS.items():
        found, value = _pop(result.config, dotted)
        if not found:
            continue
        problem = kind_problem(value, kind)
        if problem is not None:
            result.problems.append(f"{dotted}: {problem} (got {show_value(value)})")
        else:
            result.decided.append(f"{dotted} ({instead})")
    found, value = _get(result.config, "zero_optimization.sub_group_size")
    if found and kind_problem(value, "int") is None and as_number(value) == 0:
        _pop(result.config, "zero_optimization.sub_group_size")
        result.decided.append("zero_optimization.sub_group_size = 0 (zcore sizes sub-groups to the host memory)")


def _drop_unsupported(result: Translation) -> None:
    for dotted, (default, reason) in UNSUPPORTED_KEYS.items():
        found, value = _pop(result.config, dotted)
        if found and not _is_default(value, default):
            result.problems.append(
                f"config key {dotted!r} = {show_value(value)} is a DeepSpeed key zcore does not "
                f"support: {reason}. Remove it from the config."
            )


def _pop(config: dict, dotted: str) -> tuple[bool, Any]:
    """Removes the key at ``dotted`` (found, value); sections it empties go
    too, as if absent. Sections on the way are copied first, so the
    caller's config stays as it was."""
    *parents, leaf = dotted.split(".")
    section = _copied_section(config, parents)
    if section is None or leaf not in section:
        return False, None
    value = section.pop(leaf)
    for depth in range(len(parents), 0, -1):
        if _copied_section(config, parents[:depth]):
            break
        _copied_section(config, parents[:depth - 1]).pop(parents[depth - 1])
    return True, value


def _get(config: dict, dotted: str) -> tuple[bool, Any]:
    section: Any = config
    for part in dotted.split("."):
        if not isinstance(section, dict) or part not in section:
            return False, None
        section = section[part]
    return True, section


def _put(config: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    section = config
    for part in parents:
        child = section.get(part)
        section[part] = dict(child) if isinstance(child, dict) else {}
        section = section[part]
    section[leaf] = value


def _copied_section(config: dict, parents: list[str]) -> Optional[dict]:
    """The section of `config` at the path `parents`, or None where a section
    on the way is missing or not an object. Each section on the way is
    replaced in `config` by a copy, so that popping from the result leaves the
    caller's config as it was; one level each, since a recursive copy
    overflowed the stack on a deeply nested value."""
    section = config
    for part in parents:
        child = section.get(part)
        if not isinstance(child, dict):
            return None
        section[part] = dict(child)
        section = section[part]
    return section


def _is_default(value: Any, default: Any) -> bool:
    if default is _ANY:
        return False
    if isinstance(default, _OneOf):
        return any(_is_default(value, one) for one in default.values)
    if isinstance(default, _Off):
        if not isinstance(value, dict):
            return False
        switch = value.get(default.key, default.off[0])
        if isinstance(default.off[0], bool):
            return boolean_of(switch) in default.off
        return kind_problem(switch, "int") is None and as_number(switch) in default.off
    if isinstance(default, bool):
        return boolean_of(value) is default
    if isinstance(default, int):
        return kind_problem(value, "int") is None and as_number(value) == default
    if isinstance(default, str):  # DeepSpeed reads these in any case
        return isinstance(value, str) and value.lower() == default
    return value is default  # None


def kind_problem(value: Any, kind: str) -> Optional[str]:
    """Why ``value`` is not of ``kind`` as DeepSpeed reads it (with the
    coercions of zcore.config.section), or None."""
    if kind == "any":
        return None
    if kind == "section":
        return None if isinstance(value, dict) or value is None else "expected a JSON object"
    if kind == "str":
        return None if isinstance(value, str) else "expected a string"
    if kind == "bool":
        # null: DeepSpeed's dynamic default for the switches typed bool|null.
        return None if value is None or boolean_of(value) is not None else "not a boolean; use true or false (or 1 or 0)"
    number = number_in_string(value) if isinstance(value, str) else value
    if isinstance(number, bool) or not isinstance(number, (int, float)):
        return "expected a number"
    if kind == "int" and not (isinstance(number, int) or number.is_integer()):
        return "expected an integer"
    return None


def as_bool(value: Any) -> bool:
    read = boolean_of(value)
    assert read is not None, "checked with kind_problem first"
    return read


def as_number(value: Any) -> float:
    return number_in_string(value) if isinstance(value, str) else value


class _Bounded(reprlib.Repr):
    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxstring, self.maxother = 3, 80, 80
        self.maxlong = 40

    def repr_int(self, x: int, level: int) -> str:
        # repr() of an int past 4300 digits raises ValueError (int_max_str_digits).
        if x.bit_length() > 256:
            return f"<a {x.bit_length()}-bit integer>"
        return super().repr_int(x, level)


def show_value(value: Any) -> str:
    """A config value as an error message echoes it: a bounded repr, since a
    value may be nested past the recursion limit, megabytes long, or an
    integer too long for repr()."""
    return _Bounded().repr(value)
