"""Checks tests/python/deepspeed_config_fields.py against DeepSpeed 0.19.8
itself; also parses each template under deepspeed_templates/ as DeepSpeed
would under transformers' Trainer. Not part of the test suite: it needs
DeepSpeed, which zcore does not install. Run it in a virtual environment of
its own (the table module's docstring says how); it prints one line per
failed check and a summary, and exits non-zero if any check failed.

Each value is set into an otherwise minimal config (plus the row's
``requires``) and parsed by ``DeepSpeedConfig`` in a world of one gloo rank;
the parsed config is compared as a plain tree of its attributes (the raw
input dict left out) with the one parsed without the value.
"""

from __future__ import annotations

import copy
import enum
import inspect
import os
import pathlib
import sys
import traceback

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29531")

import deepspeed
import hjson
import torch
from deepspeed.runtime import lr_schedules
from deepspeed.runtime.config import ADAM_W_MODE_DEFAULT, DeepSpeedConfig
from deepspeed.runtime.engine import DeepSpeedEngine
from pydantic import BaseModel

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from deepspeed_config_fields import ABSENT, COERCIONS, FIELDS, OMITTED, REFUSED, REMOVED

BASE = {"train_micro_batch_size_per_gpu": 1}
BATCH_KEYS = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"}
# Keys whose effect DeepSpeedConfig's state does not show at world 1: only their legality is checked.
LEGALITY_ONLY = {"sequence_parallel_size", "vocabulary_size", "zero_optimization.cpu_offload_use_pin_memory"}
# Keys DeepSpeed refuses on a CPU accelerator (an assert on CUDA): only their default is checked.
CUDA_ONLY_EXAMPLES = {"aio.use_gds"}


def set_path(config: dict, path: str, value) -> None:
    *parents, leaf = path.split(".")
    node = config
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value


def merge(into: dict, extra: dict | None) -> dict:
    out = copy.deepcopy(into)
    for key, value in (extra or {}).items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def plain(x):
    """A parsed config as a comparable tree of plain values."""
    if isinstance(x, DeepSpeedConfig):
        return {k: plain(v) for k, v in vars(x).items() if k != "_param_dict"}
    if isinstance(x, BaseModel):
        # A deprecated field is removed once moved to its replacement: compare the fields that stay.
        kept = [name for name, field in type(x).model_fields.items()
                if not (field.json_schema_extra or {}).get("deprecated")]
        return {type(x).__name__: {name: plain(getattr(x, name)) for name in kept}}
    if isinstance(x, enum.Enum):
        return plain(x.value)
    if isinstance(x, dict):
        return {str(k): plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    if x is None or isinstance(x, (str, int, float, bool)):
        return x
    if isinstance(x, (torch.dtype, pathlib.PurePath)):
        return str(x)
    if hasattr(x, "__dict__"):
        return {type(x).__name__: plain(vars(x))}
    return repr(x)


def parse(config: dict):
    return plain(DeepSpeedConfig(copy.deepcopy(config)))


def reference_for(path: str, requires: dict | None) -> dict:
    """The minimal config for a value at ``path``: a batch size, the row's
    requirements, and the key's parent section present (empty) so that the
    comparison sees the key and not the section."""
    base = {"train_batch_size": 8} if path == "train_micro_batch_size_per_gpu" else BASE
    config = merge(base, requires)
    parents = path.split(".")[:-1]
    node = config
    for key in parents:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    return config


def with_value(config: dict, path: str, value) -> dict:
    out = copy.deepcopy(config)
    set_path(out, path, value)
    return out


def with_alias(config: dict, path: str, alias: str, value) -> dict:
    """``config`` with ``value`` under ``alias``, the section ``path`` names
    renamed where the two part (bf16 -> bfloat16): DeepSpeed refuses a
    field given under both names."""
    out = copy.deepcopy(config)
    keys, alias_keys = path.split("."), alias.split(".")
    node = out
    for key, alias_key in zip(keys, alias_keys):
        if key != alias_key:
            node[alias_key] = node.pop(key, {})
            break
        node = node[key]
    set_path(out, alias, value)
    return out


def optimizer_signature_default(optimizer_type: str, name: str):
    """The default of ``name`` in what DeepSpeed builds for ``optimizer_type``
    (engine.py _configure_basic_optimizer); raises KeyError for a name it
    does not take."""
    kind = optimizer_type.lower()
    engine_source = inspect.getsource(DeepSpeedEngine.get_optimizer_configuration)
    if kind in ("adam", "adamw"):
        if name == "adam_w_mode":
            return ADAM_W_MODE_DEFAULT
        if name == "torch_adam":
            assert "pop(TORCH_ADAM_PARAM, False)" in engine_source
            return False
        if name == "fp32_optimizer_states":
            from deepspeed.ops.adam.cpu_adam import DeepSpeedCPUAdam
            cls = DeepSpeedCPUAdam
        else:
            from deepspeed.ops.adam.fused_adam import FusedAdam
            cls = FusedAdam
    elif kind == "lamb":
        from deepspeed.ops.lamb.fused_lamb import FusedLamb
        cls = FusedLamb
    elif kind == "lion":
        from deepspeed.ops.lion.fused_lion import FusedLion
        cls = FusedLion
    elif kind == "adagrad":
        cls = torch.optim.Adagrad  # DeepSpeedCPUAdagrad with offload: the same defaults
    else:
        raise KeyError(optimizer_type)
    default = inspect.signature(cls.__init__).parameters[name].default
    return list(default) if isinstance(default, tuple) else default


def check_optimizer_param(row) -> list[str]:
    name = row.path.rsplit(".", 1)[1]
    optimizer_type = row.requires["optimizer"]["type"]
    default = optimizer_signature_default(optimizer_type, name)
    problems = []
    if default != row.default:
        problems.append(f"default {row.default!r}, DeepSpeed's {default!r}")
    parse(with_value(reference_for(row.path, row.requires), row.path, row.example))
    return problems


def check_scheduler_param(row) -> list[str]:
    name = row.path.rsplit(".", 1)[1]
    scheduler = row.requires["scheduler"]
    cls = getattr(lr_schedules, scheduler["type"])
    default = inspect.signature(cls.__init__).parameters[name].default
    default = ABSENT if default is inspect.Parameter.empty else default
    problems = []
    if default != row.default and not (default is ABSENT and row.default is ABSENT):
        problems.append(f"default {row.default!r}, DeepSpeed's {default!r}")
    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([weight], lr=0.1, momentum=0.9)
    params = {**scheduler.get("params", {}), name: row.example}
    cls(optimizer, **params)  # raises on an illegal value or a name it does not take
    parse(with_value(reference_for(row.path, row.requires), row.path, row.example))
    return problems


def check_field(row) -> list[str]:
    if row.path.startswith("optimizer.params."):
        return check_optimizer_param(row)
    if row.path.startswith("scheduler.params."):
        return check_scheduler_param(row)
    reference = reference_for(row.path, row.requires)
    unset = parse(reference)
    problems = []
    if row.default is not ABSENT and parse(with_value(reference, row.path, row.default)) != unset:
        problems.append(f"default {row.default!r} parses differently from leaving the key out")
    if row.path in CUDA_ONLY_EXAMPLES:
        return problems
    example = parse(with_value(reference, row.path, row.example))
    if example == unset and row.path not in LEGALITY_ONLY:
        problems.append(f"example {row.example!r} parses as leaving the key out: not read")
    for alias in row.aliases:
        if parse(with_alias(reference, row.path, alias, row.example)) != example:
            problems.append(f"alias {alias} parses differently from {row.path}")
    return problems


def check_coercion(coercion) -> list[str]:
    reference = reference_for(coercion.path, None)
    try:
        got = parse(with_value(reference, coercion.path, coercion.given))
    except Exception as exc:  # noqa: BLE001 - whatever DeepSpeed raises is a refusal
        if coercion.reads_as is REFUSED:
            return []
        return [f"refused ({type(exc).__name__}: {str(exc).splitlines()[0]})"]
    if coercion.reads_as is REFUSED:
        return ["accepted, expected a refusal"]
    expected = parse(reference) if coercion.reads_as is OMITTED else parse(
        with_value(reference, coercion.path, coercion.reads_as))
    return [] if got == expected else [f"does not parse as {coercion.reads_as!r}"]


def check_removed(path: str) -> list[str]:
    try:
        parse(with_value(BASE, path, {} if "." not in path else 1))
    except deepspeed.runtime.config.DeepSpeedConfigError:
        return []
    return ["accepted, expected DeepSpeedConfigError"]


def as_trainer_fills(config: dict) -> dict:
    """What transformers' Trainer hands DeepSpeed for a template
    (integrations/deepspeed.py trainer_config_process): its "auto" values at
    the top level and in the optimizer and scheduler replaced, for a world
    of one rank, 2 samples per rank and step, no accumulation. "auto" in the
    pydantic sections is left: DeepSpeed drops it."""
    config = copy.deepcopy(config)
    filled = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "train_batch_size": 2,
              "gradient_clipping": 1.0}
    for key, value in filled.items():
        if config.get(key) == "auto":
            config[key] = value
    params = {"lr": 5e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "warmup_min_lr": 0.0,
              "warmup_max_lr": 5e-5, "warmup_num_steps": 10, "total_num_steps": 100}
    for section in ("optimizer", "scheduler"):
        section_params = config.get(section, {}).get("params", {})
        for key, value in section_params.items():
            if value == "auto":
                section_params[key] = params[key]
    for section in ("fp16", "bf16"):
        if config.get(section, {}).get("enabled") == "auto":
            config[section]["enabled"] = False
    return config


def check_templates() -> list[tuple[str, str]]:
    results = []
    for path in sorted((HERE / "deepspeed_templates").glob("*.json")):
        try:
            # DeepSpeed reads config files with hjson (runtime/config.py)
            config = hjson.loads(path.read_text(), object_pairs_hook=dict)
            DeepSpeedConfig(as_trainer_fills(config))
            results.append((path.name, "accepted"))
        except Exception as exc:  # noqa: BLE001 - reported per template
            results.append((path.name, f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}"))
    return results


def main() -> int:
    deepspeed.init_distributed(dist_backend="gloo")
    failures = 0
    aliases = sum(len(row.aliases) for row in FIELDS)
    for label, items, check in (("field", FIELDS, check_field), ("coercion", COERCIONS, check_coercion),
                                ("removed", REMOVED, check_removed)):
        for item in items:
            name = item if isinstance(item, str) else f"{item.path} {item[1]!r}"
            try:
                problems = check(item)
            except Exception:  # noqa: BLE001 - a check that raised is a failed check
                problems = [traceback.format_exc().strip().splitlines()[-1]]
            for problem in problems:
                failures += 1
                print(f"FAIL {label} {name}: {problem}")
    print(f"{len(FIELDS)} fields ({aliases} aliases), {len(COERCIONS)} coercions, {len(REMOVED)} removed keys "
          f"checked against DeepSpeed {deepspeed.__version__}: {failures} failed")
    for name, result in check_templates():
        print(f"template {name}: {result}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
