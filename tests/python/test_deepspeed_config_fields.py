"""Every field of a DeepSpeed 0.19.8 config (deepspeed_config_fields.py,
written from DeepSpeed's source and checked against DeepSpeed itself) meets
one fate in zcore, key by key:

- honoured: the value lands in zcore's config, under every name DeepSpeed
  takes for it;
- decided: a tuning choice zcore makes itself, accepted and listed in the
  line zcore.initialize logs;
- inert: a key of a feature zcore does not support, given while the
  feature is off (it changes nothing, in DeepSpeed either);
- refused: only where zcore cannot honour the value, with a message that
  names the key.

DeepSpeed's default is accepted everywhere, and never is a key DeepSpeed
reads dropped as unknown. The coercions DeepSpeed's models make (1 for
true, 5e8 for an integer, "auto" as the default) give zcore the config the
plain value gives.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

import zcore
from zcore.config.keys import UNSUPPORTED_KEYS
from zcore.config.schema import load_config
from deepspeed_config_fields import ABSENT, COERCIONS, FIELDS, OMITTED, REFUSED

BASE = {"train_batch_size": 2}


def merged(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


# DeepSpeed's other names of a config section.
ALIASED_SECTIONS = {"bf16": "bfloat16"}


def with_value(requires: Any, path: str, value: Any) -> dict:
    """``requires`` with ``path`` set to ``value``; what ``requires`` sets in
    the section ``path`` names by another of DeepSpeed's names ("bf16" for
    "bfloat16") moves there."""
    *parents, leaf = path.split(".")
    requires = dict(requires or {})
    for other in [k for k in requires if parents and ALIASED_SECTIONS.get(k) == parents[0]]:
        requires[parents[0]] = requires.pop(other)
    config = merged(BASE, requires)
    node = config
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[leaf] = value
    return config


def outcome(config: dict) -> Any:
    try:
        return load_config(config)
    except zcore.ConfigError as exc:
        return exc


def parsed_at(cfg: Any, path: str) -> Any:
    node = cfg
    for part in path.split("."):
        node = getattr(node, part, None)
    return node


# Keys DeepSpeed reads into another key of its config.
LANDS_AT = {"allgather_size": "zero_optimization.allgather_bucket_size"}


def row_id(field) -> str:
    kind = ((field.requires or {}).get("optimizer") or (field.requires or {}).get("scheduler") or {}).get("type")
    return f"{kind}:{field.path}" if kind else field.path


def fate(field, value: Any) -> str:
    config = with_value(field.requires, field.path, value)
    got = outcome(config)
    if isinstance(got, zcore.ConfigError):
        return "refused"
    ignored = got._ignored_keys
    assert field.path.split(".")[0] not in ignored, f"{field.path}: a key DeepSpeed reads was ignored as unknown"
    decided = got.decided_keys_line() or ""
    names = [prefix for name in (field.path, *field.aliases) for prefix in prefixes(name)]
    if any(f"{prefix} (" in decided or f"{prefix} =" in decided for prefix in names):
        return "decided"
    if any(prefix in UNSUPPORTED_KEYS for prefix in names):
        # A key of a feature zcore does not support, with the feature off
        # (hybrid_engine without enabled, tensor_parallel at autotp_size 0):
        # it changes nothing, in DeepSpeed too.
        return "inert"
    return "honoured"


def prefixes(path: str) -> list[str]:
    parts = path.split(".")
    return [".".join(parts[:n]) for n in range(1, len(parts) + 1)]


@pytest.mark.parametrize("field", FIELDS, ids=[row_id(f) for f in FIELDS])
def test_each_deepspeed_field_is_honoured_decided_or_refused_naming_it(field):
    required = outcome(merged(BASE, field.requires or {}))
    if isinstance(required, zcore.ConfigError):
        # The field belongs to something zcore refuses as a whole (an
        # optimizer it does not build): that refusal names what it is.
        assert any(prefix in str(required) for key in field.requires for prefix in prefixes(key)), str(required)
        return
    if field.default is not ABSENT:
        assert fate(field, field.default) != "refused", (
            f"{field.path} at DeepSpeed's default {field.default!r}: {outcome(with_value(field.requires, field.path, field.default))}")
    got = outcome(with_value(field.requires, field.path, field.example))
    if isinstance(got, zcore.ConfigError):
        names = (field.path, *field.aliases, field.path.split(".")[0])
        assert any(name in str(got) for name in names), str(got)
        return
    if fate(field, field.example) == "honoured":
        if field.path in LANDS_AT:
            assert parsed_at(got, LANDS_AT[field.path]) == field.example, field.path
        else:
            assert field.path.split(".")[0] in got.model_fields_set, f"{field.path}: accepted, but in no fate"


@pytest.mark.parametrize("field", [f for f in FIELDS if f.aliases], ids=[row_id(f) for f in FIELDS if f.aliases])
def test_deepspeeds_other_names_of_a_field_mean_the_same(field):
    expected = outcome(with_value(field.requires, field.path, field.example))
    for alias in field.aliases:
        got = outcome(with_value(field.requires, alias, field.example))
        if isinstance(expected, zcore.ConfigError):
            assert isinstance(got, zcore.ConfigError), alias
        else:
            assert not isinstance(got, zcore.ConfigError), (alias, got)
            assert got.model_dump() == expected.model_dump(), alias


# zcore refuses a boolean where a number goes: DeepSpeed's pydantic reads
# true as 1, which no config means for a size.
STRICTER = [("zero_optimization.reduce_bucket_size", True)]
CHECKED = [c for c in COERCIONS
           if c.reads_as is not REFUSED and not any(c.path == p and c.given is g for p, g in STRICTER)]


def test_zcore_refuses_a_boolean_for_a_size_where_deepspeed_reads_1():
    with pytest.raises(zcore.ConfigError, match="reduce_bucket_size: .*a boolean is not allowed here"):
        load_config(with_value({}, "zero_optimization.reduce_bucket_size", True))


@pytest.mark.parametrize("coercion", CHECKED, ids=[f"{c.path}={c.given!r}" for c in CHECKED])
def test_values_deepspeed_coerces_mean_what_they_mean_to_deepspeed(coercion):
    given = outcome(with_value({}, coercion.path, coercion.given))
    if coercion.reads_as is OMITTED:
        plain = outcome(BASE)
    else:
        plain = outcome(with_value({}, coercion.path, coercion.reads_as))
    if isinstance(plain, zcore.ConfigError):
        assert isinstance(given, zcore.ConfigError), (coercion, given)
        return
    assert not isinstance(given, zcore.ConfigError), (coercion, given)
    assert given.model_dump() == plain.model_dump(), coercion
