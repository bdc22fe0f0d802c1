"""The reference model of zcore's config, for the config fuzz tests
(test_config_fuzz.py, test_config_files.py, test_config_initialize.py), and
the hypothesis strategies and helpers they share.

What is accepted, and as what, is stated here on its own (SCHEMA, with the
coercions listed above it), not read from zcore, so a value the config takes
silently in another form fails the tests.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

import zcore
from zcore.config.schema import load_config

# Deterministic (CI runs the same examples every time) and short.
FUZZ = settings(
    max_examples=250,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

LIMIT = 2**62  # the largest magnitude any integer key takes

# A valid config that sets every key zcore implements, and the DeepSpeed keys
# zcore accepts only at DeepSpeed's default.
BASE = {
    "train_batch_size": 32,
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "optimizer": {
        "type": "AdamW",
        "params": {
            "lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01,
            "adam_w_mode": True, "torch_adam": False, "amsgrad": False,
        },
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": 0.0, "warmup_max_lr": 3e-4, "warmup_num_steps": 100,
            "warmup_type": "linear", "last_batch_iteration": -1, "total_num_steps": 1000,
        },
    },
    "bf16": {"enabled": False},
    "fp16": {
        "enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
        "hysteresis": 2, "consecutive_hysteresis": False, "min_loss_scale": 1,
    },
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": 5e8,
        "allgather_bucket_size": 500000000,
        "offload_optimizer": {
            "device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True, "buffer_count": 4,
            "pipeline_read": True, "pipeline_write": False, "fast_init": False, "ratio": 1.0,
        },
        "offload_param": {
            "device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True, "buffer_count": 5,
            "buffer_size": 1e8, "max_in_cpu": 1e9,
        },
        "sub_group_size": 1e9,
        "stage3_prefetch_bucket_size": 5e7,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_param_persistence_threshold": 100000,
        "stage3_rank_agreement_check": "recording",
        "overlap_comm": True, "contiguous_gradients": True, "reduce_scatter": True,
        "allgather_partitions": True, "round_robin_gradients": False,
        "load_from_fp32_weights": True, "elastic_checkpoint": False, "cpu_offload": False,
    },
    "aio": {
        "block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
        "overlap_events": True, "use_gds": False, "thread_count": 1,
    },
    "communication_data_type": "fp32",
    "steps_per_print": 100,
    "out_of_step_check": {"enabled": True, "patience_seconds": 300},
    "zero_allow_untested_optimizer": False,
    "prescale_gradients": False, "gradient_predivide_factor": 1.0, "sparse_gradients": False,
    "wall_clock_breakdown": False, "dump_state": False, "memory_breakdown": False,
}

# The base config with DeepSpeed's 1-bit Adam or 0/1 Adam (its tutorials'
# values, every params key set). The config takes them at any stage;
# zcore.initialize refuses stages 1-3 (test_config_initialize.py).
COMPRESSED_PARAMS = {
    "lr": 4e-4, "betas": [0.9, 0.98], "eps": 1e-8, "weight_decay": 0.01, "bias_correction": False,
    "eps_inside_sqrt": False, "max_grad_norm": 0.0, "amsgrad": False, "cuda_aware": False, "comm_backend_name": "nccl",
}
COMPRESSED = ("OneBitAdam", "ZeroOneAdam")
BASES = {
    "AdamW": BASE,
    "OneBitAdam": {**BASE, "optimizer": {"type": "OneBitAdam", "params": {**COMPRESSED_PARAMS, "freeze_step": 23000}}},
    "ZeroOneAdam": {**BASE, "optimizer": {"type": "ZeroOneAdam", "params": {
        **COMPRESSED_PARAMS, "var_freeze_step": 1000, "var_update_scaler": 16, "local_step_scaler": 1000,
        "local_step_clipper": 16,
    }}},
}


# What each key takes. A kind maps a JSON value to the value the parsed
# config must hold, GONE (accepted and dropped) or REFUSED. The coercions
# allowed (documented; DeepSpeed's pydantic models take the same):
#   1. an integral float (5e8) for an integer key: the int;
#   2. an int for a float key: the float of the same value (exactly);
#   3. betas: a JSON list of two numbers, a tuple of floats;
#   4. optimizer.type: "adam"/"adamw"/"onebitadam"/"zerooneadam" in any case, the canonical name;
#   5. zero_optimization.offload_optimizer or offload_param, or aio: null, all defaults;
#   6. a DeepSpeed key zcore does not support, at DeepSpeed's default: dropped (GONE);
#   7. a boolean key: 1 and 0 (int or float), and the words true/yes/on/t/y/1
#      and false/no/off/f/n/0 in any case;
#   8. a number key that takes no string: a string holding a JSON number
#      (spaces around it allowed), that number;
#   9. a DeepSpeed tuning key with a value of its type: dropped (GONE);
#  10. "auto" at any key of zero_optimization (and its offload sections),
#      fp16 and bf16: dropped (DeepSpeed's default); sub_group_size 0: dropped;
#  11. a top-level key neither DeepSpeed nor zcore reads: dropped;
#  12. a section that 6, 9 or 10 leave empty: dropped with them;
#  13. "zero_optimization": true or false (DeepSpeed's oldest form): stage 1
#      with allgather_bucket_size from the top-level allgather_size (5e8), or stage 0;
#  14. steps_per_print Infinity (Accelerate's "never") or null (DeepSpeed's): 2**62;
#  15. communication_data_type in any case: lower case; an optimizer or
#      scheduler section whose type is null: dropped.
# "auto" is accepted as itself where the key allows it.
REFUSED = object()
GONE = object()
Kind = Callable[[Any], Any]

_WORDS = {"true": True, "yes": True, "on": True, "t": True, "y": True, "1": True,
          "false": False, "no": False, "off": False, "f": False, "n": False, "0": False}


def json_number(v: Any) -> Any:
    """A number, or a string holding a JSON number (coercion 8); REFUSED otherwise."""
    if type(v) is str:
        text = v.strip()
        if not re.fullmatch(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?", text):
            return REFUSED
        return int(text) if re.fullmatch(r"-?[0-9]+", text) else float(text)
    return v if type(v) in (int, float) else REFUSED


def integer(lo: int = -LIMIT, hi: int = LIMIT, strings: bool = True) -> Kind:
    def kind(v: Any) -> Any:
        if type(v) is str and not strings:
            return REFUSED
        v = json_number(v)
        if type(v) is float and v.is_integer():
            v = int(v)  # coercion 1
        return v if type(v) is int and lo <= v <= hi and abs(v) <= LIMIT else REFUSED
    return kind


def real(lo: float = -math.inf, strict: bool = False) -> Kind:
    def kind(v: Any) -> Any:
        v = json_number(v)
        if type(v) is int and abs(v) <= LIMIT and float(v) == v:
            v = float(v)  # coercion 2
        if type(v) is not float or not math.isfinite(v):
            return REFUSED
        return v if (v > lo if strict else v >= lo) else REFUSED
    return kind


def multiple_of(step: int, base: Kind) -> Kind:
    def kind(v: Any) -> Any:
        e = base(v)
        return e if e is REFUSED or e % step == 0 else REFUSED
    return kind


def boolean(v: Any) -> Any:
    if type(v) is bool:
        return v
    if type(v) in (int, float) and v in (0, 1):
        return bool(v)  # coercion 7
    return _WORDS.get(v.lower(), REFUSED) if type(v) is str else REFUSED


def string(v: Any) -> Any:
    return v if type(v) is str else REFUSED


def one_of(*allowed: Any) -> Kind:
    # Exact type: 1 is not True, 3.0 is not "3".
    return lambda v: v if any(type(v) is type(a) and v == a for a in allowed) else REFUSED


def false_only(v: Any) -> Any:
    """A boolean key that takes only false (what zcore does anyway)."""
    return False if boolean(v) is False else REFUSED


def true_only(v: Any) -> Any:
    """A boolean key that takes only true (what zcore does anyway)."""
    return True if boolean(v) is True else REFUSED


def either(*kinds: Kind) -> Kind:
    def kind(v: Any) -> Any:
        return next((e for e in (k(v) for k in kinds) if e is not REFUSED), REFUSED)
    return kind


def null(v: Any) -> Any:
    return None if v is None else REFUSED


def betas(v: Any) -> Any:
    if type(v) is not list or len(v) != 2:
        return REFUSED
    parts = [real()(b) for b in v]
    ok = all(p is not REFUSED and 0.0 <= p < 1.0 for p in parts)
    return tuple(parts) if ok else REFUSED  # coercion 3


def optimizer_type(v: Any) -> Any:
    canonical = {"adam": "Adam", "adamw": "AdamW", "onebitadam": "OneBitAdam", "zerooneadam": "ZeroOneAdam",
                 "muon": "Muon"}
    return canonical.get(v.lower(), REFUSED) if type(v) is str else REFUSED  # coercion 4


def fraction(v: Any) -> Any:
    """A float in [0, 1)."""
    e = real()(v)
    return e if e is not REFUSED and 0.0 <= e < 1.0 else REFUSED


def zero(v: Any) -> Any:
    """A float key that takes only 0: any other value asks for what neither DeepSpeed nor zcore does."""
    e = real()(v)
    return e if e is not REFUSED and e == 0.0 else REFUSED


def deepspeed_default(default: bool) -> Kind:
    return lambda v: GONE if boolean(v) is default else REFUSED  # coercion 6


def tuning(kind: str) -> Kind:
    """A DeepSpeed tuning key: any value of its JSON type is dropped (coercion 9)."""
    def check(v: Any) -> Any:
        if kind == "bool":
            ok = v is None or boolean(v) is not REFUSED  # null: DeepSpeed's dynamic default
        elif kind == "section":
            ok = v is None or type(v) is dict
        else:
            number = json_number(v)
            ok = number is not REFUSED and (kind == "float" or type(number) is int or number.is_integer())
        return GONE if ok else REFUSED
    return check


class Section:
    def __init__(self, keys: dict[str, Kind], required: tuple[str, ...] = (), null: str = "refused",
                 auto_is_default: bool = False):
        self.keys, self.required, self.null, self.auto_is_default = keys, required, null, auto_is_default

    def __call__(self, v: Any) -> Any:
        if v is None and self.null != "refused":
            return None if self.null == "none" else {}  # coercion 5: {} is all defaults
        if not isinstance(v, dict) or any(k not in v for k in self.required):
            return REFUSED
        expected = {k: self.expect(k, x) for k, x in v.items()}
        if REFUSED in expected.values():
            return REFUSED
        return GONE if v and all(e is GONE for e in expected.values()) else expected  # coercion 12

    def expect(self, key: str, x: Any) -> Any:
        if self.auto_is_default and type(x) is str and x == "auto":
            return GONE  # coercion 10
        return self.keys[key](x) if key in self.keys else REFUSED


class ZeroSection(Section):
    """zero_optimization: sub_group_size 0 is dropped (coercion 10), and
    cpu_offload (DeepSpeed's deprecated switch) true stands for an
    offload_optimizer section with device "cpu" where none is given."""

    def __call__(self, v: Any) -> Any:
        if isinstance(v, dict) and "cpu_offload" in v and boolean(v["cpu_offload"]) is True:
            if "offload_optimizer" in v:
                return REFUSED
            v = {**{k: x for k, x in v.items() if k != "cpu_offload"}, "offload_optimizer": {"device": "cpu"}}
        return super().__call__(v)

    def expect(self, key: str, x: Any) -> Any:
        if key == "cpu_offload":
            return GONE if x is None or boolean(x) is False else REFUSED  # true was read above
        if key == "sub_group_size" and type(x) is not bool and json_number(x) == 0:
            return GONE
        return super().expect(key, x)


class Optimizer:
    """The optimizer's type picks its params' keys."""

    adam = {"lr": real(0.0, strict=True), "betas": betas, "eps": real(0.0, strict=True), "weight_decay": real(0.0)}
    # 1-bit Adam and 0/1 Adam: DeepSpeed's keys that it takes and never
    # applies, accepted only at what both do anyway; comm_backend_name only
    # where it selects torch.distributed.
    compressed = {
        **adam, "bias_correction": boolean, "eps_inside_sqrt": false_only, "max_grad_norm": zero,
        "amsgrad": false_only, "cuda_aware": false_only, "comm_backend_name": one_of("nccl", "gloo", "compressed"),
    }
    adam_params = Section({**adam, "adam_w_mode": boolean, "torch_adam": boolean, "amsgrad": false_only})
    params = {
        "Adam": adam_params,
        "AdamW": adam_params,
        "OneBitAdam": Section({**compressed, "freeze_step": integer(1)}),
        "ZeroOneAdam": Section({
            **compressed, "var_freeze_step": integer(0), "var_update_scaler": integer(1),
            "local_step_scaler": integer(1), "local_step_clipper": integer(1),
        }),
        # DeepSpeed's Muon keys; its per-head orthogonalisation is refused,
        # and so is an AdamW half that is not decoupled or not in fp32.
        "Muon": Section({
            "lr": either(real(0.0, strict=True), null), "muon_lr": either(real(0.0, strict=True), null),
            "adam_lr": either(real(0.0, strict=True), null), "momentum": fraction, "weight_decay": real(0.0),
            "betas": betas, "eps": real(0.0, strict=True), "ns_method": one_of("standard", "gram"),
            "adam_w_mode": true_only, "torch_adam": boolean, "foreach": either(boolean, null),
            "fp32_optimizer_states": true_only, "per_head_muon": false_only,
        }),
    }

    def __call__(self, v: Any) -> Any:
        if v is None:
            return None
        if isinstance(v, dict) and "type" in v and v["type"] is None:
            return GONE  # coercion 15
        kind = optimizer_type(v.get("type")) if type(v) is dict else REFUSED
        if kind is REFUSED:
            return REFUSED
        return Section({"type": optimizer_type, "params": self.params[kind], "legacy_fusion": tuning("bool")},
                       ("type",))(v)


class Scheduler:
    """The scheduler's type picks its params' keys."""

    warmup = {
        "warmup_min_lr": real(), "warmup_max_lr": either(real(), null), "warmup_num_steps": integer(1),
        "warmup_type": one_of("log", "linear"), "last_batch_iteration": integer(),
    }
    cosine = {
        "total_num_steps": integer(1), "warmup_min_ratio": real(), "warmup_num_steps": integer(1),
        "cos_min_ratio": real(), "warmup_type": one_of("log", "linear"), "last_batch_iteration": integer(),
    }
    one_cycle = {
        "cycle_min_lr": real(), "cycle_max_lr": real(), "decay_lr_rate": real(),
        "cycle_first_step_size": integer(1), "cycle_second_step_size": either(integer(0), null),
        "cycle_first_stair_count": integer(), "cycle_second_stair_count": either(integer(), null),
        "decay_step_size": integer(0), "cycle_momentum": boolean, "cycle_min_mom": real(),
        "cycle_max_mom": real(), "decay_mom_rate": real(), "last_batch_iteration": integer(),
    }
    range_test = {
        "lr_range_test_min_lr": real(), "lr_range_test_step_size": integer(1), "lr_range_test_step_rate": real(),
        "lr_range_test_staircase": boolean, "last_batch_iteration": integer(),
    }
    params = {
        "WarmupLR": (Section(warmup), False),
        "WarmupDecayLR": (Section({**warmup, "total_num_steps": integer(1)}, ("total_num_steps",)), True),
        "WarmupCosineLR": (Section(cosine, ("total_num_steps",)), True),
        "OneCycle": (Section(one_cycle, ("cycle_min_lr", "cycle_max_lr")), True),
        "LRRangeTest": (Section(range_test), False),
    }

    def __call__(self, v: Any) -> Any:
        if v is None:
            return None
        if isinstance(v, dict) and "type" in v and v["type"] is None:
            return GONE  # coercion 15
        if type(v) is not dict or type(v.get("type")) is not str or v["type"] not in self.params:
            return REFUSED
        section, params_required = self.params[v["type"]]
        keys = {"type": one_of(v["type"]), "params": section}
        return Section(keys, ("type", "params") if params_required else ("type",))(v)


# DeepSpeed's tuning keys in the sections below, by the JSON type each takes.
ZERO_TUNING = {
    **{k: tuning("bool") for k in (
        "overlap_comm", "contiguous_gradients", "reduce_scatter", "allgather_partitions", "round_robin_gradients",
        "load_from_fp32_weights", "elastic_checkpoint", "ignore_unused_parameters")},
}
TUNING_PATHS = {f"zero_optimization.{k}" for k in ZERO_TUNING} | {
    "zero_optimization.offload_optimizer.ratio", "aio.single_submit", "aio.overlap_events", "aio.use_gds",
    "aio.thread_count",
    "prescale_gradients", "gradient_predivide_factor", "dump_state", "memory_breakdown",
}
int_auto_or_null = either(integer(strings=False), one_of("auto"), null)
SCHEMA = Section({
    "train_batch_size": int_auto_or_null,
    "train_micro_batch_size_per_gpu": int_auto_or_null,
    "gradient_accumulation_steps": int_auto_or_null,
    "gradient_clipping": real(0.0),
    "optimizer": Optimizer(),
    "scheduler": Scheduler(),
    "bf16": Section({"enabled": boolean}, auto_is_default=True),
    "fp16": Section({
        "enabled": boolean, "loss_scale": real(0.0), "initial_scale_power": integer(0, 64),
        "loss_scale_window": integer(1), "hysteresis": integer(1), "consecutive_hysteresis": boolean,
        "min_loss_scale": real(0.0, strict=True),
    }, auto_is_default=True),
    "zero_optimization": ZeroSection({
        "stage": integer(0, 3),
        "reduce_bucket_size": integer(1),
        "allgather_bucket_size": integer(1),
        "offload_optimizer": Section({
            "device": one_of("none", "cpu", "nvme"), "nvme_path": either(string, null), "pin_memory": boolean,
            "buffer_count": integer(1), "pipeline_read": boolean, "pipeline_write": boolean,
            "fast_init": boolean, "ratio": tuning("float"),
        }, null="defaults", auto_is_default=True),
        "offload_param": Section({
            "device": one_of("none", "cpu", "nvme"), "nvme_path": either(string, null), "pin_memory": boolean,
            "buffer_count": integer(1), "buffer_size": integer(1), "max_in_cpu": integer(0),
        }, null="defaults", auto_is_default=True),
        "sub_group_size": integer(1),
        "stage3_prefetch_bucket_size": integer(0),
        "stage3_max_live_parameters": integer(0),
        "stage3_max_reuse_distance": integer(0),
        "stage3_param_persistence_threshold": integer(0),
        "stage3_gather_16bit_weights_on_model_save": boolean,
        "stage3_rank_agreement_check": one_of("recording", "every_module"),
        **ZERO_TUNING,
    }, auto_is_default=True),
    "aio": Section({
        "block_size": multiple_of(4096, integer(1, 1 << 30)), "queue_depth": integer(1, 1024),
        "intra_op_parallelism": integer(1, 64), "single_submit": tuning("bool"),
        "overlap_events": tuning("bool"), "use_gds": tuning("bool"), "thread_count": tuning("int"),
    }, null="defaults"),
    "communication_data_type": either(lambda v: v.lower() if type(v) is str and v.lower() in ("fp32", "fp16", "bf16")
                                      else REFUSED, null),
    "steps_per_print": either(integer(1), lambda v: LIMIT if v is None or (type(v) is float and v == math.inf)
                              else REFUSED),
    "zero_allow_untested_optimizer": boolean,
    "dataloader_drop_last": boolean,
    "out_of_step_check": Section({"enabled": boolean, "patience_seconds": real(0.0, strict=True)}),
    **{k: tuning("bool") for k in ("prescale_gradients", "dump_state", "memory_breakdown")},
    "sparse_gradients": deepspeed_default(False),
    "wall_clock_breakdown": boolean,
    "gradient_predivide_factor": tuning("float"),
})
# Top-level keys DeepSpeed reads that zcore does not hold (so never dropped
# as unknown): coercion 11 drops any other.
DEEPSPEED_TOP_LEVEL = {
    "zero_force_ds_cpu_optimizer", "disable_allgather", "disable_python_gc", "managed_gradient_accumulation",
    "log_level", "comms_logger", "timers", "autotuning", "comet", "compile", "datastates",
    "seq_parallel_communication_data_type", "use_data_before_expert_parallelism", "activation_checkpointing",
    "pipeline", "data_types", "gradient_allreduce_op", "torch_autocast", "amp", "hybrid_engine", "elasticity",
    "data_efficiency", "curriculum_learning", "compression_training", "sparse_attention", "weight_quantization",
    "tensor_parallel", "expert_parallel", "bfloat16", "checkpoint",
}


def expected_config(raw: Any) -> Any:
    """What load_config must return for `raw` (as nested expected values), or REFUSED."""
    if isinstance(raw, dict) and type(raw.get("zero_optimization")) is bool:  # coercion 13
        switch = raw["zero_optimization"]
        zero = {"stage": 1, "allgather_bucket_size": raw.get("allgather_size", 500_000_000)} if switch else {"stage": 0}
        raw = {**{k: v for k, v in raw.items() if k != "allgather_size"}, "zero_optimization": zero}
    if isinstance(raw, dict):  # coercion 11
        raw = {k: v for k, v in raw.items() if k in SCHEMA.keys or k in DEEPSPEED_TOP_LEVEL}
    expected = SCHEMA(raw)
    if expected is REFUSED:
        return REFUSED
    if expected is GONE:
        return {}
    enabled = [isinstance(expected.get(s), dict) and expected[s].get("enabled") is True for s in ("bf16", "fp16")]
    if all(enabled):
        return REFUSED  # at most one of bf16 and fp16
    zero = expected.get("zero_optimization")
    if not isinstance(zero, dict):
        return expected
    for section in ("offload_optimizer", "offload_param"):
        offload = zero.get(section)
        if isinstance(offload, dict) and offload.get("device") == "nvme" and not offload.get("nvme_path"):
            return REFUSED  # NVMe offload needs a directory: a non-empty nvme_path
    param = zero.get("offload_param")
    if isinstance(param, dict) and param.get("device", "none") != "none" and zero.get("stage", 0) != 3:
        # Read at stage 3 only (parameters are sharded, so offloaded, there):
        # ignored below, as DeepSpeed ignores it; an emptied section goes too.
        zero = {**zero, "offload_param": GONE}
        left = any(v is not GONE for v in zero.values())
        expected = {**expected, "zero_optimization": zero if left else GONE}
    return expected


def assert_holds(expected: Any, parsed: Any, where: str = "config") -> None:
    """The parsed config holds exactly the expected values, of the same types,
    and sets nothing that was not given."""
    if isinstance(expected, dict):
        given_keys = {k for k, e in expected.items() if e is not GONE}
        assert parsed.model_fields_set == given_keys, where
        for key in given_keys:
            assert_holds(expected[key], getattr(parsed, key), f"{where}.{key}")
    else:
        assert type(parsed) is type(expected) and parsed == expected, (where, expected, parsed)
        if isinstance(expected, tuple):
            assert all(type(p) is type(e) for p, e in zip(parsed, expected)), where


# JSON values, with the edges that break parsers and validators. Values
# whose repr() fails (huge ints, deep nesting) are built, not listed, so that
# hypothesis can describe its strategies.
HUGE = st.builds(pow, st.just(10), st.just(5000))  # past int_max_str_digits
INTS = st.integers() | HUGE | st.sampled_from([0, 1, -1, 2**53 + 1, LIMIT, LIMIT + 1, -LIMIT - 1, 2**63, 2**64, 10**30])
FLOATS = st.floats() | st.sampled_from([5e8, 1e300, 3.0, 0.5, -0.0, 2.0**70, float("nan"), float("inf")])
TEXT = st.text(max_size=12) | st.sampled_from(
    ["auto", "AUTO", "Adam", "adamw", "ADAMW", "cpu", "none", "nvme", "log", "linear", "fp16",
     "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "recording", "every_module", "true", "1", "5e8",
     "", "\ud800", "\x00", "é" * 3]
) | st.just(20_000).map("x".__mul__)
SCALARS = st.none() | st.booleans() | INTS | FLOATS | TEXT
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


class DeepList(list):
    """A list nested past the interpreter's recursion limit, with a repr
    that hypothesis can report."""

    def __repr__(self) -> str:
        return "[[[...100000 deep...]]]"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))


class DeepDict(dict):
    def __repr__(self) -> str:
        return '{"a": {"a": ...100000 deep...}}'

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))


def nested_lists(depth: int) -> DeepList:
    value: Any = 0
    for _ in range(depth - 1):
        value = [value]
    return DeepList([value])


def nested_dicts(depth: int) -> DeepDict:
    value: Any = 0
    for _ in range(depth - 1):
        value = {"a": value}
    return DeepDict(a=value)


# Nesting past the interpreter's recursion limit, for anything that walks a
# value (built once: load_config must not change what it is given).
_DEEP = {"lists": nested_lists(100_000), "dicts": nested_dicts(100_000)}
DEEP = st.sampled_from(sorted(_DEEP)).map(_DEEP.__getitem__)
# Values near what the keys take, so that many substitutions are accepted
# and their parsed form is checked.
PLAUSIBLE = st.one_of(
    st.integers(-3, 70),
    st.integers(-3, 70).map(float),
    st.floats(0, 1),
    st.lists(st.floats(0, 1) | st.integers(0, 1), min_size=2, max_size=2),
    st.sampled_from([
        "auto", "adam", "AdamW", "ADAM", "OneBitAdam", "zerooneadam", "gloo", "mpi", "cpu", "none", "nvme",
        "log", "linear", "bf16", "every_module",
    ]),
    st.sampled_from([4096, 6144, 1 << 20, 1.5 * (1 << 20)]),  # aio.block_size: multiples of 4096 or not
    st.sampled_from([
        None, True, False, {}, {"enabled": True}, {"device": "cpu"}, {"type": "Adam"}, {"type": "ZeroOneAdam"},
        {"device": "nvme"}, {"device": "nvme", "nvme_path": ""}, {"device": "nvme", "nvme_path": "/nvme"},
    ]),
)
VALUES = JSON | DEEP | PLAUSIBLE


def key_paths(config: dict, prefix: str = "") -> list[str]:
    paths = []
    for key, value in config.items():
        paths.append(prefix + key)
        if isinstance(value, dict):
            paths += key_paths(value, f"{prefix}{key}.")
    return paths


def value_at(config: dict, path: str) -> Any:
    for key in path.split("."):
        if config is GONE:
            return GONE  # a section dropped whole
        config = config[key]
    return config


# (base, key path): every key of the base config, and the optimizer
# section's keys in the others (which differ from it only there).
KEYS = [("AdamW", p) for p in key_paths(BASE)] + [
    (base, p) for base in COMPRESSED for p in key_paths(BASES[base]) if p.startswith("optimizer")
]
LEAVES = [(base, p) for base, p in KEYS if not isinstance(value_at(BASES[base], p), dict)]


def with_value(base: str, path: str, value: Any) -> dict:
    config = json.loads(json.dumps(BASES[base]))
    *sections, key = path.split(".")
    node = config
    for section in sections:
        node = node[section]
    node[key] = value
    return config


def refusal(config: Any) -> str:
    """load_config's message; fails the test on any other exception."""
    with pytest.raises(zcore.ConfigError) as info:
        load_config(config)
    return str(info.value)


def problem_lines(message: str) -> list[str]:
    lines = message.splitlines()
    return lines[1:] if lines[0].startswith("invalid zcore config") else lines


def names(line: str, path: str) -> bool:
    # An optimizer or scheduler type that does not match the params is
    # reported at the section or its params (the type decides which params
    # are valid).
    key = path.split(".")[0] if path in ("optimizer.type", "scheduler.type") else path
    return re.search(rf"(?<![\w.]){re.escape(key)}(?!\w)", line) is not None


def variants(v: Any) -> list[Any]:
    """Variations of a valid value: other types and spellings of it."""
    if type(v) in (int, float):
        return [v, int(v), float(v), 2 * v, -v, 0, 0.0, v + 0.5, True, str(v)]
    if type(v) is str:
        return [v, v.lower(), v.upper(), v + " ", 1]
    if type(v) is bool:
        return [v, not v, int(v), float(v), str(v).lower()]
    return [v, {}, [], None]


def near(v: Any) -> st.SearchStrategy:
    return st.sampled_from(variants(v))


# Values that a bound tells apart (> 0 from >= 0, a multiple of 4096 from one
# of 512, a default from another value), tried at every key: a random draw
# reaches a given key's edge too rarely.
EDGES = [None, "", 0, 1, -1, 2, 512, 4096, 4097]
