"""zcore.initialize with untrusted arguments, fuzzed with hypothesis: its
own arguments of the wrong kind, refused naming the argument; a bad config,
refused as load_config refuses it; and DeepSpeed's 1-bit Adam and 0/1 Adam,
built as configured at ZeRO stage 0 and refused naming the key under ZeRO
stages 1-3 or an offloaded optimizer.

What the config accepts, and as what, is stated on its own in
config_reference.py, not read from zcore, and so are the optimizers' defaults
here.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st

import zcore
from zcore.config.schema import load_config
from zcore.optim import OneBitAdam, ZeroOneAdam
from config_reference import (
    BASE, BASES, COMPRESSED, EDGES, FUZZ, JSON, KEYS, REFUSED, VALUES, expected_config, names, near, refusal,
    value_at, with_value,
)


# zcore.initialize's own arguments.
@FUZZ
@given(
    argument=st.sampled_from(["model", "optimizer", "model_parameters", "collate_fn", "meta_init", "tied_parameters"]),
    value=JSON,
)
def test_initialize_refuses_an_argument_of_the_wrong_kind_naming_it(argument, value):
    # JSON values are never callable, a module or a MetaInit; a list is an
    # iterable of parameters as far as the argument's kind goes.
    assume(value is not None or argument == "model")
    assume(not (argument == "model_parameters" and isinstance(value, list)))
    assume(not (argument == "tied_parameters" and value == {}))  # no ties
    arguments = {"model": torch.nn.Linear(2, 2), "config": BASE, argument: value}
    with pytest.raises(zcore.InvalidArgumentError, match=rf"zcore\.initialize\({argument}=") as info:
        zcore.initialize(**arguments)
    assert info.value.argument == argument


@FUZZ
@given(key=st.sampled_from(KEYS), value=VALUES)
def test_initialize_reports_a_bad_config_as_load_config_does(key, value):
    config = with_value(*key, value)
    assume(expected_config(config) is REFUSED)
    with pytest.raises(zcore.ConfigError) as info:
        zcore.initialize(model=torch.nn.Linear(2, 2), config=config)
    assert str(info.value) == refusal(config)


# 1-bit Adam and 0/1 Adam take the place of ZeRO stage 0's all-reduce, on
# the device: zcore.initialize builds them at stage 0 with the values given
# (DeepSpeed's defaults for the others), and refuses stages 1-3 and an
# offloaded optimizer naming the key.
COMPRESSED_DEFAULTS = {
    "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "freeze_step": 100_000,
    "var_freeze_step": 100_000, "var_update_scaler": 16, "local_step_scaler": 32678, "local_step_clipper": 16,
}
# Each type's class, and its attributes that hold its own keys.
COMPRESSED_OPTIMIZERS = {
    "OneBitAdam": (OneBitAdam, ("freeze_step",)),
    "ZeroOneAdam": (ZeroOneAdam, ("var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper")),
}
NOT_AT_STAGE_0 = [  # zero_optimization, and the key the refusal names
    pytest.param({"stage": 1}, "zero_optimization.stage", id="stage-1"),
    pytest.param({"stage": 2}, "zero_optimization.stage", id="stage-2"),
    pytest.param({"stage": 3}, "zero_optimization.stage", id="stage-3"),
    pytest.param({"stage": 2, "offload_optimizer": {"device": "cpu"}}, "zero_optimization.stage", id="stage-2-offload"),
    pytest.param(
        {"stage": 0, "offload_optimizer": {"device": "cpu"}}, "zero_optimization.offload_optimizer.device",
        id="stage-0-offload",
    ),
]


@st.composite
def compressed_sections(draw: st.DrawFn, valid: bool) -> dict:
    """A 1-bit Adam or 0/1 Adam optimizer section (its type in any case)
    with a few of its params, each as in the base config or, unless `valid`,
    another type or spelling of it or an edge."""
    kind = draw(st.sampled_from(COMPRESSED))
    given = value_at(BASES[kind], "optimizer.params")
    keys = draw(st.lists(st.sampled_from(sorted(given)), unique=True, max_size=3))
    around = st.just if valid else lambda v: st.just(v) | near(v) | st.sampled_from(EDGES)
    return {
        "type": draw(st.sampled_from([kind, kind.lower(), kind.upper()])),
        "params": {k: draw(around(given[k])) for k in keys},
    }


def initialize_refusal(config: dict) -> str:
    with pytest.raises(zcore.ConfigError) as info:
        zcore.initialize(model=torch.nn.Linear(2, 2), config=config)
    return str(info.value)


@settings(FUZZ, max_examples=100)
@given(section=compressed_sections(valid=False))
def test_initialize_builds_1_bit_and_0_1_adam_as_configured(section):
    config = {"train_batch_size": 4, "optimizer": section}
    expected = expected_config(config)
    if expected is REFUSED:
        assert initialize_refusal(config) == refusal(config)
        event("refused by the config")
        return
    kind = expected["optimizer"]["type"]
    cls, own_keys = COMPRESSED_OPTIMIZERS[kind]
    values = {**COMPRESSED_DEFAULTS, **expected["optimizer"]["params"]}
    engine, optimizer, *_ = zcore.initialize(model=torch.nn.Linear(2, 2), config=config)
    try:
        assert type(optimizer.inner) is cls
        for key in ("lr", "betas", "eps", "weight_decay"):
            assert optimizer.inner.param_groups[0][key] == values[key], key
        for key in own_keys:
            assert getattr(optimizer.inner, key) == values[key], key
    finally:
        engine.destroy()
    event(f"built {kind}")


@pytest.mark.parametrize("zero, key", NOT_AT_STAGE_0)
@settings(FUZZ, max_examples=20)
@given(section=compressed_sections(valid=True))
def test_initialize_refuses_1_bit_and_0_1_adam_under_zero_or_offload_naming_the_key(zero, key, section):
    config = {"train_batch_size": 4, "optimizer": section, "zero_optimization": zero}
    load_config(config)  # the config takes them at any stage
    message = initialize_refusal(config)
    kind = next(kind for kind in COMPRESSED if kind.lower() == section["type"].lower())
    assert kind in message and names(message, key), message


def test_initialize_lists_deepspeeds_tuning_keys_once_and_warns_of_keys_nobody_reads(caplog):
    config = {
        "train_batch_size": 2, "optimizer": {"type": "AdamW"},
        "zero_optimization": {"stage": 2, "overlap_comm": False, "round_robin_gradients": True},
        "zero_force_ds_cpu_optimizer": False, "comms_config": {"verbose": False},
    }
    with caplog.at_level("INFO", logger="zcore"):
        zcore.initialize(model=torch.nn.Linear(2, 2), config=config)
    records = [r for r in caplog.records if r.name == "zcore" and "DeepSpeed" in r.getMessage()]
    warnings = [r.getMessage() for r in records if r.levelname == "WARNING"]
    infos = [r.getMessage() for r in records if r.levelname == "INFO"]
    assert len(warnings) == 1 and "'comms_config'" in warnings[0] and "neither DeepSpeed nor zcore" in warnings[0]
    assert len(infos) == 1
    for key, instead in [("zero_optimization.overlap_comm", "always overlaps"),
                         ("zero_optimization.round_robin_gradients", "equal share"),
                         ("zero_force_ds_cpu_optimizer", "fused CPU Adam")]:
        assert f"{key} (zcore {instead}" in infos[0] or (key in infos[0] and instead in infos[0]), infos[0]
