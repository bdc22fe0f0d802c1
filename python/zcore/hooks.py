"""All of zcore's autograd integration for ZeRO stages 0-2: one
post-accumulate-grad hook per trained parameter, delegating to the reducer."""

from __future__ import annotations

import functools

from zcore.grad_reduction import GradientReducer
from zcore.partition import FlatUnit


def register_gradient_hooks(units: list[FlatUnit], reducer: GradientReducer) -> list:
    handles = []
    for u, unit in enumerate(units):
        for i, param in enumerate(unit.params):
            hook = functools.partial(reducer.on_grad, u, i)
            handles.append(param.register_post_accumulate_grad_hook(hook))
    return handles
