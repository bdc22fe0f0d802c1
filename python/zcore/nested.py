"""Tensors inside the nested values modules take and return (tuples, lists,
namedtuples, dicts and model-output classes)."""

from __future__ import annotations

import copy
from typing import Any

import torch


def replace_tensors(value: Any, passed: dict[int, torch.Tensor]) -> Any:
    """``value`` with each tensor whose id is a key of ``passed`` replaced by
    its value, rebuilt as the same kind of container."""
    if isinstance(value, torch.Tensor):
        return passed.get(id(value), value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(replace_tensors(v, passed) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(replace_tensors(v, passed) for v in value)
    if isinstance(value, dict):
        out = copy.copy(value)  # keeps dict subclasses (model-output classes) intact
        for k, v in value.items():
            out[k] = replace_tensors(v, passed)
        return out
    return value


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor in ``value``, through tuples, lists and dicts, in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_in(v)]
    return []
