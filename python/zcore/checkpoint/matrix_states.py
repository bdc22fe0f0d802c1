"""Whole-matrix optimizer states (Shampoo's preconditioners: what
``MatrixOptimizer.direction`` keeps for a whole matrix, on the rank that
owns it: zcore.step.matrix_step) in zcore's checkpoints.

Each is a tensor of the rank's state file named ``matrix::<parameter
name>::<key>``, written by the matrix's owner in the replica that writes
shards (every rank computes every matrix at stage 0 or on one rank: the
first data-parallel rank writes them). A load reads each matrix's from
whichever rank wrote it, on the rank that owns the matrix now, at any
world size.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from zcore.checkpoint.layout import EngineLayout

PREFIX = "matrix::"


def _matrix_step(engine: Any) -> Optional[Any]:
    optimizer = engine.optimizer
    return getattr(optimizer.update, "matrix", None) if optimizer is not None else None


def _name(engine: Any, layout: EngineLayout, m: Any) -> str:
    return layout.names[id(engine.optimizer.units[m.unit].params[m.param_index])]


def saved_tensors(engine: Any, layout: EngineLayout) -> dict[str, torch.Tensor]:
    """The whole-matrix states this rank writes, by tensor name."""
    step = _matrix_step(engine)
    if step is None:
        return {}
    writes = engine.ranks.writes_shards if step.exchanges else engine.ranks.data_parallel.rank == 0
    if not writes:
        return {}
    out = {}
    for m in step.matrices:
        for key, value in step.whole_states.get(m.index, {}).items():
            out[f"{PREFIX}{_name(engine, layout, m)}::{key}"] = value
    return out


def staged_states(engine: Any, layout: EngineLayout, indexes: list[Any], read_whole: Any) -> Optional[dict]:
    """The whole-matrix states of the matrices this rank computes, by
    matrix index, read from the ranks that wrote them
    (``read_whole(rank, "state", name)``); None without a whole-matrix optimizer."""
    step = _matrix_step(engine)
    if step is None:
        return None
    where = {
        name: ix.rank for ix in reversed(indexes) for name in ix.files.state.tensors if name.startswith(PREFIX)
    }
    states: dict[int, dict[str, torch.Tensor]] = {}
    for m in step.matrices:
        if not step.computes(m):
            continue
        prefix = f"{PREFIX}{_name(engine, layout, m)}::"
        for name, rank in where.items():
            if name.startswith(prefix):
                states.setdefault(m.index, {})[name[len(prefix):]] = read_whole(rank, "state", name)
    return states
