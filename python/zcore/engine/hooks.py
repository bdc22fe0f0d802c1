"""All of zcore's autograd and module integration.

Stages 0-3: one post-accumulate-grad hook per trained parameter, delegating
to the gradient reducer.

Stage 3: a second post-accumulate-grad hook per trained parameter (note
"backward without input gradients" below), and four module hooks per module
with parameters (and on the model itself), each delegating to the
ParamFetcher that owns the state:
- forward pre-hook: enter the module (gather its groups); its tensor inputs
  pass through ``_OnBackward`` (leaving), whose backward runs once autograd has
  computed the gradients of those inputs, i.e. after the module's backward;
- forward post-hook: leave the module; its tensor outputs that require grad
  pass through ``_OnBackward`` (entering), whose backward runs before any of the
  module's backward nodes (they consume its outputs) and enters the
  module's backward. (One autograd node per call: a multi-grad hook costs
  ~90 us per module call in handle bookkeeping, measured.)
- the leaving ``_OnBackward`` node's backward: leave the module's backward.

Note "backward without input gradients": a module whose inputs need no
gradient (the first embedding: its inputs are token ids) gets no leaving
node. Every backward node of such a call leads to its trained parameters'
gradients (there is nothing else to compute), so the call leaves its
backward when autograd has accumulated all of them: one post-accumulate-grad
hook per trained parameter tells the fetcher. Without it the call's groups
would stay gathered until the end of backward (where the fetcher still
closes calls whose gradients never all came).

Under torch.compile the module hooks run outside Dynamo's graphs: a
compiled module is hooked as one unit whose hooks Dynamo does not trace,
and the modules inside it lose theirs (note "compiled units" in
zcore.engine.compiled_units).

The forward post-hook also hands the tensors of the module's output to the
fetcher, which takes over a parameter returned to the calling module (note
"external parameters" in zcore.zero3.external_params).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable

import torch

from zcore.step.grad_reduction import GradientReducer
from zcore.zero3.module_calls import ModuleCall
from zcore.nested import replace_tensors, tensors_in
from zcore.zero3.param_fetcher import ParamFetcher
from zcore.step.units import Unit


def register_gradient_hooks(units: list[Unit], reducer: GradientReducer) -> list:
    handles = []
    for u, unit in enumerate(units):
        for i, param in enumerate(unit.params):
            hook = functools.partial(_call_weakly, weakref.WeakMethod(reducer.on_grad), u, i)
            handles.append(param.register_post_accumulate_grad_hook(hook))
    return handles


def register_backward_exit_hooks(fetcher: ParamFetcher) -> list:
    """Stage 3, note "backward without input gradients"."""
    hook = functools.partial(_call_weakly, weakref.WeakMethod(fetcher.grad_accumulated))
    return [p.register_post_accumulate_grad_hook(hook) for g in fetcher.groups if g.trainable for p in g.params]


def _call_weakly(method: weakref.WeakMethod, *args: Any) -> None:
    """``method(*args)`` while its object lives. A parameter's hooks are
    held from C++, where the garbage collector cannot see a cycle through
    them back to the parameter: a strong reference would keep an engine
    dropped without destroy() alive, its swap files too, until exit."""
    bound = method()
    if bound is not None:
        bound(*args)


def register_module_hooks(fetcher: ParamFetcher, modules: dict[int, torch.nn.Module]) -> list:
    """``modules[k]`` is the fetcher's hooked module k."""
    handles = []
    for k, module in modules.items():
        pair = [
            module.register_forward_pre_hook(
                functools.partial(_forward_pre, fetcher, k), with_kwargs=True, prepend=True
            ),
            module.register_forward_hook(functools.partial(_forward_post, fetcher, k), with_kwargs=True),
        ]
        _MODULE_HOOKS.setdefault(fetcher, {}).setdefault(k, []).extend(pair)
        handles += pair
    return handles


# Each fetcher's module hooks by hooked module k: a compiled unit removes
# those of the modules inside it (note "compiled units" in zcore.engine.compiled_units).
_MODULE_HOOKS: "weakref.WeakKeyDictionary[ParamFetcher, dict[int, list]]" = weakref.WeakKeyDictionary()


def register_unit_hooks(fetcher: ParamFetcher, k: int, module: torch.nn.Module, inside: list[int]) -> list:
    """Hooked module ``k`` runs compiled, gathering for the hooked modules
    ``inside`` it (itself among them, if it was hooked), whose own hooks
    are removed: its graph has none. Its hooks run outside the compiled
    region."""
    for i in inside:
        for handle in _MODULE_HOOKS.get(fetcher, {}).pop(i, []):
            handle.remove()
    return [
        module.register_forward_pre_hook(
            functools.partial(_enter_outside_graph, fetcher, k), with_kwargs=True, prepend=True
        ),
        module.register_forward_hook(functools.partial(_leave_outside_graph, fetcher, k), with_kwargs=True),
    ]


class _OnBackward(torch.autograd.Function):
    """Identity in forward; in backward, calls ``event()`` and passes the
    gradients on."""

    @staticmethod
    def forward(ctx: Any, event: Callable[[], None], *tensors: torch.Tensor):
        ctx.event = event
        # Returned as-is, they would be views of the inputs made by a
        # multi-output Function, which autograd forbids changing in place
        # (transformers' Trainer scales the loss with `loss *= ...`).
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor):
        ctx.event()
        return (None, *grads)


def _forward_pre(fetcher: ParamFetcher, k: int, module: torch.nn.Module, args: tuple, kwargs: dict):
    if torch.compiler.is_compiling():  # in a compiled module that is no unit
        return _enter_outside_graph(fetcher, k, module, args, kwargs)
    return _enter(fetcher, k, module, args, kwargs)


def _forward_post(fetcher: ParamFetcher, k: int, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any):
    if torch.compiler.is_compiling():
        return _leave_outside_graph(fetcher, k, module, args, kwargs, output)
    return _leave(fetcher, k, module, args, kwargs, output)


def _enter(fetcher: ParamFetcher, k: int, module: torch.nn.Module, args: tuple, kwargs: dict):
    call = fetcher.enter_forward(k)
    return _through_backward_exit(fetcher, call, args, kwargs)


def _leave(fetcher: ParamFetcher, k: int, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any):
    tensors = tensors_in(output)
    call = fetcher.exit_forward(k, tensors)
    if call is None:  # hooked during this very call
        return None
    return _through_backward_entry(fetcher, call, tensors, output)


# Dynamo runs these as they are, outside its graph (it breaks the graph around the call).
_enter_outside_graph = torch.compiler.disable(_enter)
_leave_outside_graph = torch.compiler.disable(_leave)


def _through_backward_exit(fetcher: ParamFetcher, call: ModuleCall, args: tuple, kwargs: dict):
    if not torch.is_grad_enabled():
        return None
    flat = list(args) + list(kwargs.values())
    where = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor) and a.requires_grad]
    if not where:
        fetcher.exit_backward_after_grads(call)
        return None
    leave = functools.partial(fetcher.exit_backward, call)
    passed = _OnBackward.apply(leave, *(flat[i] for i in where))
    for i, t in zip(where, passed):
        flat[i] = t
    return tuple(flat[: len(args)]), dict(zip(kwargs, flat[len(args) :]))


def _through_backward_entry(
    fetcher: ParamFetcher, call: ModuleCall, tensors: list[torch.Tensor], output: Any
) -> Any:
    """``output`` (holding ``tensors``) with its grad-requiring tensors passed
    through one entering _OnBackward node (None, keeping ``output``, when
    there are none)."""
    if not torch.is_grad_enabled():
        return None
    tensors = [t for t in tensors if t.requires_grad]
    if not tensors:
        return None
    entered = _OnBackward.apply(functools.partial(fetcher.enter_backward, call), *tensors)
    passed = dict(zip(map(id, tensors), entered))
    return replace_tensors(output, passed)
