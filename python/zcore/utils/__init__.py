"""DeepSpeed's ``deepspeed.utils`` names, for code written against DeepSpeed:
the tensor-fragment calls that read and write one parameter's master
weights, optimizer states and gradient although ZeRO cuts them across the
ranks, the leaf-module helpers, ``RepeatingLoader``, and (in
``zcore.utils.zero_to_fp32``) the whole model's weights from a checkpoint.

    from zcore.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    engine.backward(loss)
    grad = safe_get_full_grad(p)                 # every rank: a collective
    engine.step()
    exp_avg = safe_get_full_optimizer_state(p, "exp_avg")

What each returns, and when (zcore.engine.fragments):

- ``safe_get_full_*``: the whole value in fp32 on the engine's device, on
  every rank. A collective over the data-parallel ranks: call it on all of
  them, for the same parameters in the same order.
- ``safe_set_full_*``: every rank gives the same whole value and keeps its
  own part of it; not a collective.
- ``safe_get_local_*`` / ``safe_set_local_*``: this rank's part, 1-D (empty
  where the rank holds none of the parameter). At stages 1-3 the parts of
  the ranks, in rank order, make up the whole flattened value; at stage 0
  every rank's part is the whole.
- Master weights: at any time; a write reaches the model's parameters at
  the next optimizer step, as in DeepSpeed (to change the parameters now,
  write them in ``zcore.GatheredParameters(params, modifier_rank=0)``).
- Optimizer states (``"exp_avg"``, ``"exp_avg_sq"``): from the parameter's
  first step on.
- Gradients (in fp32; under fp16 still multiplied by the loss scale, as
  DeepSpeed holds them): from an ``engine.backward()`` until
  ``engine.step()``, averaged over the ranks at the end of an accumulation
  window; within one (or in ``engine.no_sync()``), at stages 0-1 this
  rank's own sum so far (not a collective then, as DeepSpeed's
  ``param.grad``), at stages 2-3 the reduced shards so far; None before a
  window's first backward and after the step. A written gradient is what
  the step applies.
- A parameter zcore does not train (frozen, or outside the optimizer's
  groups) gives None, and writes to it do nothing, as in DeepSpeed.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch

from zcore.engine import fragments
from zcore.engine.fragments import MASTER
from zcore.errors import InvalidArgumentError
from zcore.zero3.leaf_modules import (
    get_z3_leaf_modules,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)

__all__ = [
    "RepeatingLoader",
    "get_z3_leaf_modules",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "safe_update_full_grad_vectorized",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
]


def safe_get_full_fp32_param(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """The whole fp32 master weights of ``param``. Collective."""
    return _on(param, "safe_get_full_fp32_param", False, lambda t, _: fragments.full(t, MASTER))


def safe_set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """``value`` (the whole parameter) becomes ``param``'s master weights."""
    _on(param, "safe_set_full_fp32_param", True, lambda t, caller: fragments.set_full(t, MASTER, value, caller))


def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> Optional[torch.Tensor]:
    """The whole optimizer state ``optim_state_key`` (``"exp_avg"``) of ``param``, in fp32. Collective."""
    return _on(param, "safe_get_full_optimizer_state", False, lambda t, _: fragments.full(t, _key(optim_state_key)))


def safe_set_full_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """``value`` (the whole parameter's) becomes optimizer state ``optim_state_key`` of ``param``."""
    _on(param, "safe_set_full_optimizer_state", True,
        lambda t, caller: fragments.set_full(t, _key(optim_state_key), value, caller))


def safe_get_full_grad(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """The whole fp32 gradient of ``param`` (None where there is none). Collective."""
    return _on(param, "safe_get_full_grad", False, lambda t, _: fragments.full_grad(t))


def safe_set_full_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """``value`` (the whole parameter's) becomes the gradient the step applies to ``param``."""
    _on(param, "safe_set_full_grad", True, lambda t, caller: fragments.set_full_grad(t, value, caller))


def safe_get_local_fp32_param(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """This rank's part of ``param``'s fp32 master weights, 1-D."""
    return _on(param, "safe_get_local_fp32_param", False, lambda t, _: fragments.local(t, MASTER))


def safe_set_local_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """``value`` becomes this rank's part of ``param``'s master weights."""
    _on(param, "safe_set_local_fp32_param", True, lambda t, caller: fragments.set_local(t, MASTER, value, caller))


def safe_get_local_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> Optional[torch.Tensor]:
    """This rank's part of optimizer state ``optim_state_key`` of ``param``, 1-D in fp32."""
    return _on(param, "safe_get_local_optimizer_state", False,
               lambda t, _: fragments.local(t, _key(optim_state_key)))


def safe_set_local_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """``value`` becomes this rank's part of optimizer state ``optim_state_key`` of ``param``."""
    _on(param, "safe_set_local_optimizer_state", True,
        lambda t, caller: fragments.set_local(t, _key(optim_state_key), value, caller))


def safe_get_local_grad(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """This rank's part of ``param``'s fp32 gradient, 1-D (None where there is none)."""
    return _on(param, "safe_get_local_grad", False, lambda t, _: fragments.local_grad(t))


def safe_set_local_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """``value`` becomes this rank's part of the gradient the step applies to ``param``."""
    _on(param, "safe_set_local_grad", True, lambda t, caller: fragments.set_local_grad(t, value, caller))


def safe_update_full_grad_vectorized(
    param_list: Iterable[torch.nn.Parameter], update_func: Callable[[torch.Tensor, torch.nn.Parameter], Any]
) -> None:
    """Each trained parameter's whole gradient becomes ``update_func(gradient,
    param)``; parameters zcore does not train are passed over. Collective."""
    caller = "safe_update_full_grad_vectorized"
    located = [(fragments.locate(p, caller, writes=True), p) for p in param_list]
    trained = [(target, p) for target, p in located if target is not None]
    fragments.update_full_grads([t for t, _ in trained], update_func, [p for _, p in trained], caller)


class RepeatingLoader:
    """DeepSpeed's ``deepspeed.utils.RepeatingLoader``: iterates over
    ``loader`` again and again, starting it afresh whenever it ends (a
    DistributedSampler's epoch stays as set: call ``set_epoch`` on it to
    reshuffle)."""

    def __init__(self, loader: Iterable) -> None:
        self.loader = loader
        self._iterator = iter(loader)

    def __iter__(self) -> "RepeatingLoader":
        return self

    def __next__(self) -> Any:
        try:
            return next(self._iterator)
        except StopIteration:
            self._iterator = iter(self.loader)
            return next(self._iterator)  # an empty loader ends here too


def _on(param: Any, caller: str, writes: bool, action: Callable[[fragments.Target, str], Any]) -> Any:
    """``action(target, caller)`` on ``param``'s place in its engine; None
    (nothing done) for a parameter the engine does not train, as DeepSpeed."""
    target = fragments.locate(param, caller, writes)
    return None if target is None else action(target, caller)


def _key(optim_state_key: Any) -> str:
    if not isinstance(optim_state_key, str):
        raise InvalidArgumentError(
            f"optim_state_key names an optimizer state (\"exp_avg\", \"exp_avg_sq\"), got "
            f"{type(optim_state_key).__name__} {optim_state_key!r}",
            argument="optim_state_key",
        )
    return optim_state_key
