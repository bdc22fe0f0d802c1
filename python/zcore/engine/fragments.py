"""One parameter's training state, whole or this rank's part: DeepSpeed's
tensor-fragment API (``deepspeed.utils.safe_get_full_fp32_param`` and its
companions, zcore.utils).

A trained parameter's master weights, optimizer states and fp32 gradient
are cut across the ranks with its unit (zcore.step.units): each rank holds
one *piece* of it, or none. The whole value is each rank's piece in place
in a zero tensor, summed over the ranks that share the unit's shards (the
world, or MiCS's shard group); this rank's part is its piece. A write of a
whole value keeps the piece of it this rank holds, so every rank must be
given the same value; only reads of whole values are collectives.

What the calls see, and when (as in DeepSpeed):
- the master weights (fp32, or bf16 with bf16 master weights: returned in
  fp32) at any time; a write changes the master only, and the model's
  compute-dtype parameters take it at the next optimizer step;
- a ranged optimizer state (Adam's ``exp_avg``, ``exp_avg_sq``) once the
  optimizer has made it, at the parameter's first step;
- the gradient (in fp32, loss-scaled under fp16, as DeepSpeed holds it)
  from a backward until the step: at the window's end, averaged over the
  ranks; within a window (gradient accumulation, ``engine.no_sync()``), at
  stages 2-3 the shards reduced so far, and at stages 0-1 this rank's own
  sum so far, not yet reduced (read and written on this rank alone, as
  DeepSpeed's ``param.grad`` there); None before a window's first backward
  and after the step. A written gradient is what the step then applies.

Parameters that zcore does not train (frozen, or left out of the
optimizer's groups) give None, and writes to them do nothing, as
DeepSpeed's do. Values on NVMe are read and written one sub-group at a time.
"""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from zcore.checkpoint.full_state import refuse_model_parallel
from zcore.comm import collectives as comm
from zcore.engine.engine import Engine, MicroStep
from zcore.errors import InvalidArgumentError, InvalidStateError
from zcore.step.swapped_optimizer import SwappedMaster, resting_keys, state_rows
from zcore.step.units import Piece, Unit

MASTER = None  # the state key that stands for the master weights

# Each parameter of a trained model -> a weak reference to its engine.
_ENGINES: WeakIdKeyDictionary = WeakIdKeyDictionary()
_INDEXES: "weakref.WeakKeyDictionary[Engine, ParamIndex]" = weakref.WeakKeyDictionary()


def track(engine: Engine) -> None:
    """The parameters of ``engine``'s model answer the fragment calls."""
    ref = weakref.ref(engine)
    for p in engine.module.parameters():
        _ENGINES[p] = ref


@dataclass(frozen=True)
class Place:
    unit: int
    index: int  # of the parameter in its unit
    piece: Optional[int]  # the unit's piece that is this rank's part of it (None: no part here)


class ParamIndex:
    """Where each trained parameter of an engine is, and its name."""

    def __init__(self, engine: Engine) -> None:
        units: list[Unit] = engine.optimizer.units
        pieces = {(u, meta.param_index): k for u, unit in enumerate(units) for k, meta in enumerate(unit.pieces)}
        self.places = {
            id(p): Place(u, i, pieces.get((u, i))) for u, unit in enumerate(units) for i, p in enumerate(unit.params)
        }
        self.names = {id(p): name for name, p in engine.module.named_parameters(remove_duplicate=False)}


@dataclass(frozen=True)
class Target:
    """A trained parameter of a live engine, located."""

    engine: Engine
    unit: Unit
    place: Place
    name: str

    @property
    def meta(self) -> Optional[Piece]:
        return None if self.place.piece is None else self.unit.pieces[self.place.piece]

    @property
    def numel(self) -> int:
        return self.unit.shapes[self.place.index].numel()

    @property
    def shape(self) -> torch.Size:
        return self.unit.shapes[self.place.index]

    @property
    def device(self) -> torch.device:
        return self.engine.context.device


def locate(param: Any, caller: str, writes: bool) -> Optional[Target]:
    """``param``'s place in its engine; None where the engine does not train it."""
    if not isinstance(param, torch.nn.Parameter):
        raise InvalidArgumentError(f"{caller} takes a torch.nn.Parameter, got a {type(param).__name__}",
                                   argument="param")
    ref = _ENGINES.get(param)
    engine = ref() if ref is not None else None
    if engine is None:
        raise InvalidArgumentError(
            f"{caller}: this parameter (shape {tuple(param.shape)}) is not in a model that zcore.initialize "
            "trains; pass a parameter of the model zcore.initialize wrapped (engine.module.parameters())",
            argument="param",
        )
    if writes:
        engine.lifetime.check_usable()
    else:
        engine.lifetime.check_not_destroyed()
    if engine.optimizer is None:
        raise InvalidStateError(
            f"{caller}: the engine of this parameter has no optimizer (an inference engine), so it holds no "
            "master weights, gradients or optimizer states; give zcore.initialize an optimizer to train"
        )
    refuse_model_parallel(engine, caller)
    index = _INDEXES.get(engine)
    if index is None:
        index = _INDEXES[engine] = ParamIndex(engine)
    place = index.places.get(id(param))
    if place is None:
        return None
    engine._finish_step()  # a step still running behind the forward changes the master and the states
    if writes:
        engine.checkpoints.finish_copy()  # an asynchronous save may still be copying these values
    name = index.names.get(id(param), "<unnamed>")
    return Target(engine, engine.optimizer.units[place.unit], place, name)


# Reads.
def full(target: Target, key: Optional[str]) -> torch.Tensor:
    """The whole master (``key`` MASTER) or optimizer state ``key``, in
    fp32 on the engine's device. Collective over the ranks sharing the shards."""
    values, missing = _read_piece(target, key) if target.meta is not None else (None, None)
    # Two trailing counters: ranks lacking the state, ranks without the key,
    # so that every rank raises the same error after the one collective.
    counters = torch.zeros(2)
    if missing is not None:
        counters[missing] = 1
    whole, (lacking, unknown) = _summed(target, values, counters)
    if lacking or unknown:
        raise _state_error(target, key, lacking > 0)
    return whole


def local(target: Target, key: Optional[str]) -> torch.Tensor:
    """This rank's piece of the master or of optimizer state ``key``, 1-D in
    fp32 on the engine's device (empty where this rank holds none)."""
    if target.meta is None:
        return torch.empty(0, dtype=torch.float32, device=target.device)
    values, missing = _read_piece(target, key)
    if values is None:
        raise _state_error(target, key, missing == 0)
    return values.to(device=target.device, dtype=torch.float32, copy=True)


def full_grad(target: Target) -> Optional[torch.Tensor]:
    """The whole gradient, or None where there is none (module docstring).
    Collective over the ranks sharing the shards, except within a window at
    stages 0-1 (this rank's own sum, whole here)."""
    window = _window(target)
    if window is Window.NONE:
        return None
    if window is Window.LOCAL:
        return _local_sum(target).to(device=target.device, copy=True).view(target.shape)
    return _summed(target, _grad_piece(target) if target.meta is not None else None, torch.zeros(0))[0]


def local_grad(target: Target) -> Optional[torch.Tensor]:
    window = _window(target)
    if window is Window.NONE:
        return None
    if target.meta is None:
        return torch.empty(0, dtype=torch.float32, device=target.device)
    piece = _local_piece(target) if window is Window.LOCAL else _grad_piece(target)
    return piece.to(device=target.device, copy=True)


# Writes.
def set_full(target: Target, key: Optional[str], value: Any, caller: str) -> None:
    """This rank's piece of the whole ``value`` into the master or state ``key``."""
    flat = _checked_value(value, target.numel, f"the whole parameter {target.name!r} {tuple(target.shape)}", caller)
    meta = target.meta
    if meta is not None:
        _write_piece(target, key, flat[meta.param_start : meta.param_start + meta.numel], caller)


def set_local(target: Target, key: Optional[str], value: Any, caller: str) -> None:
    meta = target.meta
    flat = _checked_value(value, 0 if meta is None else meta.numel, _local_what(target), caller)
    if meta is not None:
        _write_piece(target, key, flat, caller)


def set_full_grad(target: Target, value: Any, caller: str) -> None:
    flat = _checked_value(value, target.numel, f"the whole parameter {target.name!r} {tuple(target.shape)}", caller)
    if _required_window(target, caller) is Window.LOCAL:
        _mark_used(target)
        _local_sum(target).copy_(flat)
        return
    meta = target.meta
    _write_grad_piece(target, None if meta is None else flat[meta.param_start : meta.param_start + meta.numel])


def set_local_grad(target: Target, value: Any, caller: str) -> None:
    meta = target.meta
    flat = _checked_value(value, 0 if meta is None else meta.numel, _local_what(target), caller)
    if _required_window(target, caller) is Window.LOCAL:
        _mark_used(target)
        if meta is not None:
            _local_piece(target).copy_(flat)
        return
    _write_grad_piece(target, None if meta is None else flat)


def update_full_grads(targets: list[Target], update: Callable[[torch.Tensor, torch.nn.Parameter], Any],
                      params: list[torch.nn.Parameter], caller: str) -> None:
    """Each parameter's whole gradient replaced by ``update(gradient, param)``."""
    for target, param in zip(targets, params):
        _required_window(target, caller)
        set_full_grad(target, update(full_grad(target), param), caller)


# The pieces where they live.
def _read_piece(target: Target, key: Optional[str]) -> tuple[Optional[torch.Tensor], Optional[int]]:
    """(values, None), or (None, 0) where the state is not made yet, (None,
    1) where the optimizer keeps no ranged state ``key``."""
    optimizer = target.engine.optimizer
    u, k = target.place.unit, target.place.piece
    master = optimizer.master
    if isinstance(master, SwappedMaster):
        if key is MASTER:
            return master.read_piece(u, k)[0], None
        piece = master.pieces[u][k]
        state = optimizer.inner.state.get(piece) or {}
        rows = state_rows(optimizer.inner)(piece)
        if key not in rows:
            return None, 1
        if key not in resting_keys(state, rows):
            return None, 0
        return master.read_piece(u, k)[rows[key]], None
    piece = master.pieces[u][k]
    if key is MASTER:
        return piece.detach(), None
    state = optimizer.inner.state.get(piece)
    if not state:
        return None, 0
    value = state.get(key)
    if not _ranged(value, piece):
        return None, 1
    return value.reshape(-1), None


def _write_piece(target: Target, key: Optional[str], values: torch.Tensor, caller: str) -> None:
    optimizer = target.engine.optimizer
    u, k = target.place.unit, target.place.piece
    master = optimizer.master
    if isinstance(master, SwappedMaster):
        row = 0
        if key is not MASTER:
            piece = master.pieces[u][k]
            rows = state_rows(optimizer.inner)(piece)
            if key not in rows or key not in resting_keys(optimizer.inner.state.get(piece) or {}, rows):
                raise _state_error(target, key, key in rows, caller)
            row = rows[key]
        master.write_piece(u, k, row, values)
        return
    piece = master.pieces[u][k]
    if key is MASTER:
        destination = piece.detach()
    else:
        state = optimizer.inner.state.get(piece)
        value = state.get(key) if state else None
        if not _ranged(value, piece):
            raise _state_error(target, key, not state, caller)
        destination = value.view(-1)
    with torch.no_grad():
        destination.copy_(values)


def _ranged(value: Any, piece: torch.Tensor) -> bool:
    """Whether ``value`` is a per-element state of ``piece``."""
    return isinstance(value, torch.Tensor) and value.numel() == piece.numel() and value.dim() > 0


def _grad_piece(target: Target) -> torch.Tensor:
    meta = target.meta
    shard = target.engine.optimizer.reducer.grad_shard(target.place.unit)
    return shard[meta.shard_start : meta.shard_start + meta.numel]


def _write_grad_piece(target: Target, values: Optional[torch.Tensor]) -> None:
    _mark_used(target)
    if values is None:
        return
    reducer = target.engine.optimizer.reducer
    u = target.place.unit
    meta = target.meta
    shard = reducer.grad_shard(u)
    shard[meta.shard_start : meta.shard_start + meta.numel].copy_(values)
    reducer.put_grad_shard(u, shard)


def _mark_used(target: Target) -> None:
    """The step's optimizer skips a parameter no rank gave a gradient."""
    target.engine.optimizer.reducer.window_used[target.place.unit][target.place.index] = 1


def _local_sum(target: Target) -> torch.Tensor:
    """Stages 0-1 within a window: this rank's sum of the window's
    gradients so far, the whole parameter, in place (not yet reduced)."""
    acc = target.engine.optimizer.reducer.acc[target.place.unit]
    return target.unit.param_slice(acc, target.place.index)


def _local_piece(target: Target) -> torch.Tensor:
    """This rank's part of ``_local_sum``."""
    meta = target.meta
    return _local_sum(target)[meta.param_start : meta.param_start + meta.numel]


def _summed(target: Target, piece: Optional[torch.Tensor], counters: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """The whole parameter from each rank's ``piece`` (None: no part here),
    and ``counters`` summed over the ranks, in the same collective."""
    numel = target.numel
    buf = torch.zeros(numel + counters.numel(), dtype=torch.float32, device=target.device)
    meta = target.meta
    if piece is not None:
        buf[meta.param_start : meta.param_start + meta.numel].copy_(piece)
    buf[numel:].copy_(counters)
    unit, shard = target.unit, target.engine.optimizer.shard
    if unit.shard_numel != unit.padded_numel and shard.size > 1:  # stage 0: every rank holds the whole
        comm.all_reduce_sum(buf, group=shard.group)
    return buf[:numel].view(target.shape).clone(), [int(c) for c in buf[numel:].tolist()]


# When gradients are there, and which.
class Window(enum.Enum):
    NONE = "no gradient held"  # before a window's first backward, and after the step
    REDUCED = "averaged over the ranks"  # the window's end; within it, stages 2-3 (the shards so far)
    LOCAL = "this rank's own sum"  # within a window at stages 0-1, which reduce at its end


def _window(target: Target) -> Window:
    engine = target.engine
    reducer = engine.optimizer.reducer
    if engine.micro_step_phase is MicroStep.AWAITING_BACKWARD and engine.accumulated_micro_steps == 0:
        return Window.NONE
    ended = engine.micro_step_phase is MicroStep.AWAITING_STEP and reducer.boundary
    if ended or engine.policies.stage.reduce_scatters_every_micro_step:
        return Window.REDUCED
    return Window.LOCAL


def _required_window(target: Target, caller: str) -> Window:
    window = _window(target)
    if window is Window.NONE:
        raise InvalidStateError(
            f"{caller}: no gradients are held now (they exist from an engine.backward() until engine.step()); "
            "write them after a backward, before the step"
        )
    return window


# Errors.
def _checked_value(value: Any, numel: int, what: str, caller: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise InvalidArgumentError(
            f"{caller} takes a floating-point tensor as the value, got "
            f"{type(value).__name__ if not isinstance(value, torch.Tensor) else value.dtype}",
            argument="value",
        )
    if value.numel() != numel:
        raise InvalidArgumentError(
            f"{caller}: the value has {value.numel()} elements (shape {tuple(value.shape)}), but {what} has "
            f"{numel}",
            argument="value",
        )
    return value.detach().reshape(-1)


def _local_what(target: Target) -> str:
    n = 0 if target.meta is None else target.meta.numel
    return (f"this rank's part of {target.name!r} ({n} elements: the length of safe_get_local_fp32_param's "
            "value)")


def _state_error(target: Target, key: Optional[str], not_made: bool, caller: str = "") -> Exception:
    prefix = f"{caller}: " if caller else ""
    if not_made:
        return InvalidStateError(
            f"{prefix}parameter {target.name!r} has no optimizer state {key!r} yet: the optimizer makes its "
            "states at the parameter's first step; read or write them after an engine.step() that updated it"
        )
    optimizer = target.engine.optimizer
    known = _ranged_keys(target)
    listed = f"; its per-element states are {known}" if known else ""
    return InvalidArgumentError(
        f"{prefix}{type(optimizer.inner).__name__} keeps no per-element state {key!r} for parameter "
        f"{target.name!r}{listed}",
        argument="optim_state_key",
    )


def _ranged_keys(target: Target) -> list[str]:
    """The per-element state keys of the parameter's optimizer group, as
    a piece of that group on this rank shows them (none: empty)."""
    optimizer = target.engine.optimizer
    param = target.unit.params[target.place.index]
    group = next(g for g, params in enumerate(optimizer.group_params) if any(p is param for p in params))
    for piece in optimizer.inner.param_groups[group]["params"]:
        state = optimizer.inner.state.get(piece)
        if not state:
            continue
        if isinstance(optimizer.master, SwappedMaster):
            return sorted(resting_keys(state, state_rows(optimizer.inner)(piece)))
        return sorted(key for key, value in state.items() if _ranged(value, piece))
    return []
