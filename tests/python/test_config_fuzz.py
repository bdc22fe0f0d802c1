"""The config as untrusted input, fuzzed with hypothesis: any JSON value as
the whole config or at any key of a full DeepSpeed config, at each key's edges,
and of the wrong type. Each either loads or raises zcore's error naming the
key; nothing else escapes. The optimizer section is fuzzed with each type:
DeepSpeed's Adam and AdamW, and its 1-bit Adam and 0/1 Adam.

What is accepted, and as what, is stated on its own in config_reference.py
(SCHEMA, with the coercions listed above it), not read from zcore, so a value
the config takes silently in another form fails the test. The config as a
file: test_config_files.py; through zcore.initialize: test_config_initialize.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

import zcore
from zcore.config.schema import load_config
from config_reference import (
    BASES, COMPRESSED, EDGES, FLOATS, FUZZ, GONE, HUGE, INTS, KEYS, LEAVES, LIMIT, REFUSED, TEXT, TUNING_PATHS,
    VALUES, assert_holds, expected_config, json_number, names, near, problem_lines, refusal, value_at, variants,
    with_value,
)


def over_keys(keys: list[tuple[str, str]]) -> Any:
    """Parametrize by (base, path), named by the path (after the optimizer type outside the base config)."""
    ids = [path if base == "AdamW" else f"{base}:{path}" for base, path in keys]
    return pytest.mark.parametrize("base, path", keys, ids=ids)


def parsed_at(cfg: Any, path: str) -> Any:
    for key in path.split("."):
        cfg = getattr(cfg, key)
    return cfg


@pytest.mark.parametrize("base", sorted(BASES))
def test_the_base_config_loads_as_stated(base):
    assert_holds(expected_config(BASES[base]), load_config(BASES[base]))


@FUZZ
@given(raw=VALUES)
def test_any_json_value_as_the_whole_config_loads_as_stated_or_is_refused(raw):
    expected = expected_config(raw)
    if expected is REFUSED:
        named = len(raw) if isinstance(raw, str) else 0  # a string is a path, named in full
        assert len(refusal(raw)) < 4000 + named, "the message echoes the value unbounded"
        return
    cfg = load_config(raw)
    assert_holds(expected, cfg)
    try:
        train, micro, gas = cfg.batch_sizes(world_size=2)
        assert train == micro * gas * 2 and min(train, micro, gas) > 0
    except zcore.ConfigError:
        pass


@st.composite
def substitutions(draw: st.DrawFn) -> tuple[str, str, Any]:
    base, path = draw(st.sampled_from(KEYS))
    return base, path, draw(near(value_at(BASES[base], path)) if draw(st.booleans()) else VALUES)


def check_substitution(base: str, path: str, value: Any) -> str:
    """The base config with `value` at `path` loads as stated, or is refused
    naming the key; which of the two."""
    config = with_value(base, path, value)
    expected = expected_config(config)
    if expected is REFUSED:
        message = refusal(config)
        assert all(names(line, path) for line in problem_lines(message)), (path, value, message)
        assert len(message) < 4000, "the message echoes the value unbounded"
        return "refused"
    cfg = load_config(config)
    expected_here = value_at(expected, path)
    if expected_here is not GONE:
        assert_holds(expected_here, parsed_at(cfg, path), path)
    return "accepted"


@settings(FUZZ, max_examples=600)
@given(substitution=substitutions())
def test_any_value_at_any_key_loads_as_stated_or_is_refused_naming_the_key(substitution):
    event(check_substitution(*substitution))  # --hypothesis-show-statistics


@over_keys(LEAVES)
def test_every_key_at_its_edges_loads_as_stated_or_is_refused_naming_the_key(base, path):
    v = value_at(BASES[base], path)
    off_by_one = [v - 1, v + 1] if type(v) in (int, float) else []
    for value in variants(v) + off_by_one + EDGES:
        check_substitution(base, path, value)


NUMERIC = [(base, p) for base, p in LEAVES if type(value_at(BASES[base], p)) in (int, float)]
BOOLEAN = [(base, p) for base, p in LEAVES if type(value_at(BASES[base], p)) is bool]


# Every key, each with its own examples (hypothesis tries 0, 1 and True first).
PER_KEY = settings(FUZZ, max_examples=25)


@over_keys(NUMERIC)
@PER_KEY
@given(value=st.booleans() | TEXT.filter(lambda s: s != "auto" and json_number(s) is REFUSED))
def test_booleans_and_strings_without_a_number_are_never_numbers(base, path, value):
    assert names(refusal(with_value(base, path, value)), path)


@over_keys(BOOLEAN)
@PER_KEY
@given(value=(INTS | FLOATS).filter(lambda v: v not in (0, 1)))
def test_numbers_other_than_1_and_0_are_never_booleans(base, path, value):
    assert names(refusal(with_value(base, path, value)), path)


@over_keys([(base, p) for base, p in LEAVES if p not in TUNING_PATHS])
@PER_KEY
@given(value=st.integers(min_value=LIMIT + 1) | st.integers(max_value=-LIMIT - 1) | HUGE)
def test_integers_past_2_to_the_62_are_never_accepted(base, path, value):
    if path == "optimizer.params.betas":
        value = [0.5, value]
    config = with_value(base, path, value)
    message = refusal(config)
    assert all(names(line, path) for line in problem_lines(message)), message


FLOAT_KEYS = [("AdamW", p) for p in (
    "gradient_clipping", "optimizer.params.lr", "optimizer.params.eps", "optimizer.params.weight_decay",
    "scheduler.params.warmup_min_lr", "scheduler.params.warmup_max_lr", "fp16.loss_scale", "fp16.min_loss_scale",
)] + [(base, "optimizer.params.max_grad_norm") for base in COMPRESSED]


@over_keys(FLOAT_KEYS)
@settings(FUZZ, max_examples=10)
@given(value=st.integers(2**52, LIMIT // 2 - 1).map(lambda n: 2 * n + 1))  # odd past 2**53: no float
def test_an_integer_that_a_float_key_would_round_is_refused(base, path, value):
    assert names(refusal(with_value(base, path, value)), path)
