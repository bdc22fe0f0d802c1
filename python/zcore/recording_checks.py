"""ZeRO-3 checks that run only while the coordinator records a trace.

A trace is recorded on the first step of each trace key and again after a
step departs from it; the steps in between follow it. A check here turns a
mistake that would otherwise fail cryptically (a shape error deep inside an
operator) into an error that names the module, the parameter and the fix.
It costs something per operator, which is why it runs only while
recording: a model's structure shows itself on the first step.

- ``ReleasedParameterCheck``: a torch function mode, active during a key's
  first forward, that stops the first operator given a parameter zcore has
  released, i.e. one used by a module that neither owns nor declared it
  (``zcore.register_external_parameter``). Later forwards run without it.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

import torch
from torch.overrides import TorchFunctionMode

from zcore.errors import InvalidStateError


class ReleasedParameterCheck(TorchFunctionMode):
    """While active, an operator given a zcore parameter that is not gathered
    raises an error naming it, instead of failing on its empty placeholder."""

    def __init__(
        self,
        released: Callable[[torch.Tensor], bool],
        describe_param: Callable[[torch.Tensor], str],
        describe_module: Callable[[Optional[torch.nn.Module]], str],
    ) -> None:
        super().__init__()
        self._released = released  # whether a tensor is a zcore parameter not gathered now
        self._describe_param = describe_param  # its name and shape
        self._describe_module = describe_module  # None: the innermost running hooked module

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None):
        kwargs = kwargs or {}
        # Attribute access (p.dtype, p.data = ...) reads no values: zcore's own
        # hooks and user code may do it on released parameters.
        if getattr(func, "__name__", "") not in ("__get__", "__set__"):
            for value in (*args, *kwargs.values()):
                for t in value if isinstance(value, (list, tuple)) else (value,):
                    if isinstance(t, torch.nn.Parameter) and self._released(t):
                        raise self._error(t, func)
        return func(*args, **kwargs)

    def _error(self, param: torch.Tensor, func: Any) -> InvalidStateError:
        user = self._describe_module(_calling_module())
        name = getattr(func, "__name__", repr(func))
        return InvalidStateError(
            f"{user} passes parameter {self._describe_param(param)} to {name}, but it is not "
            "gathered: ZeRO-3 gathers a parameter only while its own module runs, or a module that "
            "declared it. Declare the use before training: "
            "zcore.register_external_parameter(module, param) with that module and that parameter",
            user=user,
        )


def _calling_module() -> Optional[torch.nn.Module]:
    """The innermost module whose forward is running, from the stack (on the
    error path only): the one that used a parameter it does not own."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module) and frame.f_code.co_name == "forward":
            return owner
        frame = frame.f_back
    return None
