"""DeepSpeed config keys that zcore deliberately does not implement.

Each entry: the dotted key, the value DeepSpeed uses by default (a config
that carries exactly that value changes nothing and is accepted), and why the
key is refused otherwise. ``_ANY`` marks keys refused whatever their value.
"""

from __future__ import annotations

import reprlib
from typing import Any, Optional

_ANY = object()

UNSUPPORTED_KEYS: dict[str, tuple[Any, str]] = {
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": (
        False,
        "saving comes with zcore's sharded checkpoints (zcore consolidate for one file)",
    ),
    "zero_optimization.ignore_unused_parameters": (
        True,
        "zcore always trains with parameters that get no gradient (their shards keep their values)",
    ),
    "zero_optimization.overlap_comm": (
        True,
        "zcore always overlaps gradient reduction with backward",
    ),
    "zero_optimization.contiguous_gradients": (
        True,
        "zcore always reduces from contiguous unit buffers",
    ),
    "zero_optimization.reduce_scatter": (True, "zcore always reduce-scatters gradients"),
    "zero_optimization.allgather_partitions": (True, "zcore always all-gathers whole units"),
    "zero_optimization.round_robin_gradients": (
        False,
        "zcore's bucket layout gives each rank an equal share without it",
    ),
    "zero_optimization.load_from_fp32_weights": (True, "checkpoints always keep fp32 weights"),
    "zero_optimization.elastic_checkpoint": (False, "zcore checkpoints reload at any world size"),
    "zero_optimization.cpu_offload": (
        False,
        "use zero_optimization.offload_optimizer.device = 'cpu' (the current key)",
    ),
    "zero_optimization.offload_optimizer.ratio": (1.0, "partial optimizer offload is not supported"),
    "zero_optimization.zero_quantized_nontrainable_weights": (
        False,
        "storing frozen weights quantized is not supported; zero_quantized_weights quantizes their all-gathers",
    ),
    "fp16.auto_cast": (False, "zcore casts the model to fp16 itself; torch autocast inside it is not supported"),
    "data_types.grad_accum_dtype": (None, "zcore accumulates gradients in fp32"),
    "zero_force_ds_cpu_optimizer": (
        True,
        "zcore picks the optimizer that runs on the CPU itself (its fused CPU Adam for Adam and AdamW)",
    ),
    "aio.use_gds": (False, "GPUDirect Storage is not supported"),
    "aio.single_submit": (False, "zcore's I/O engine always submits a request's blocks as one batch"),
    "aio.overlap_events": (True, "zcore's I/O engine always overlaps submission with completion"),
    "aio.thread_count": (1, "use aio.intra_op_parallelism (its current name)"),
    "amp": (_ANY, "use bf16.enabled or fp16.enabled (zcore's own mixed precision)"),
    "activation_checkpointing": (_ANY, "use torch.utils.checkpoint in the model"),
    "prescale_gradients": (False, "zcore reduces in the communication dtype without prescaling"),
    "gradient_predivide_factor": (1.0, "zcore averages gradients after reduction"),
    "sparse_gradients": (False, "sparse gradients are not supported"),
    "dump_state": (False, "not supported"),
    "memory_breakdown": (False, "use engine.memory_report()"),
    "comet": (_ANY, "zcore's monitors are tensorboard, csv_monitor and wandb"),
    "comms_logger": (_ANY, "zcore's step metrics time collective waits (wall_clock_breakdown or a monitor)"),
    "autotuning": (_ANY, "not supported"),
    "elasticity": (_ANY, "not supported"),
    "pipeline": (
        _ANY,
        "zcore pipelines through zcore.pipelining's PipelineStage and a device_mesh with a \"pp\" "
        "dimension (docs/guide/parallelism.md), not DeepSpeed's PipelineModule",
    ),
    "compression_training": (_ANY, "not supported"),
    "data_efficiency": (_ANY, "not supported"),
    "curriculum_learning": (_ANY, "not supported"),
    "sparse_attention": (_ANY, "not supported"),
    "checkpoint.load_universal": (False, "zcore checkpoints reload at any world size as they are"),
    "checkpoint.use_node_local_storage": (False, "every rank writes to the one checkpoint directory"),
    "checkpoint.parallel_write": (
        {"pipeline_stage": False},
        "each rank of every pipeline stage writes its own shards of one checkpoint already",
    ),
}


def split_unsupported(raw: dict) -> tuple[dict, list[str]]:
    """The config without unsupported keys at their defaults, and one message
    per unsupported key set to anything else."""
    cleaned = dict(raw)
    problems = []
    for dotted, (default, reason) in UNSUPPORTED_KEYS.items():
        *parents, leaf = dotted.split(".")
        section = _copied_section(cleaned, parents)
        if section is None or leaf not in section:
            continue
        value = section.pop(leaf)
        if parents and not section:  # emptied: as if absent (data_types is no section of zcore's)
            _copied_section(cleaned, parents[:-1]).pop(parents[-1])
        if default is _ANY or not _is_default(value, default):
            problems.append(
                f"config key {dotted!r} = {show_value(value)} is a DeepSpeed key zcore does not "
                f"support: {reason}. Remove it from the config."
            )
    return cleaned, problems


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
    # A section: each key it gives carries its default.
    if isinstance(default, dict):
        return isinstance(value, dict) and all(k in default and _is_default(v, default[k]) for k, v in value.items())
    if default is None:
        return value is None
    # Python has 1 == True and 0.0 == False: a number is not a boolean's
    # default, nor a boolean a number's.
    if isinstance(value, bool) or isinstance(default, bool):
        return value is default
    return type(value) in (int, float) and value == default


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
