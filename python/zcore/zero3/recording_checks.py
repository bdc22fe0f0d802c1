"""ZeRO-3 checks that run only where no adopted trace vouches for a step.

A trace is recorded on the first step of each trace key and again after a
step departs from it; the steps in between follow it. Both checks turn a
mistake that would otherwise fail cryptically (a shape error deep inside an
operator) or hang (ranks waiting in different collectives) into an error
that names the module, the parameter and the fix. They cost something per
module or per operator, which is why they run only while recording: a
model's structure shows itself on the first step.

- ``RankAgreement``: before a module gathers at a use no trace foresaw
  (every use of a recording step, and each departure), every rank must be
  about to gather the same groups. One all-reduce of (signature, -signature)
  with MAX tells whether they all agree (the maximum of -s is minus the
  minimum of s); only when they do not, the ranks exchange what each was
  running, to say so. Its limit: where some ranks follow their trace and
  others depart, only the departing ones check, and the collectives still
  mismatch (a hang until the process group's timeout, or the backend's own
  error). Config ``stage3_rank_agreement_check: "every_module"`` checks
  every use instead, at one small all-reduce per module call, to find such
  a divergence.
- ``ReleasedParameterCheck``: a torch function mode, active during a key's
  first forward, that catches an operator given a parameter zcore has
  released, i.e. one used by a module that neither owns nor declared it
  (``zcore.register_external_parameter``): the use is declared then (note
  "external parameters" in zcore.zero3.external_params), or, outside any
  module's forward, refused by name. Later forwards run without it.
"""

from __future__ import annotations

import sys
import zlib
from array import array
from typing import Any, Callable, Optional

import torch
from torch.overrides import TorchFunctionMode

from zcore.comm import collectives as comm
from zcore.errors import InvalidStateError
from zcore.comm.topology import RankGroup

END_OF_STEP = -1  # signature of "no more uses this step" (crc32 signatures are >= 0)


def signature(groups: list[int]) -> int:
    """The same on every rank for the same groups in the same order."""
    return zlib.crc32(array("q", groups).tobytes())


class RankAgreement:
    """Checks, use by use, that every rank enters the same groups."""

    def __init__(self, device: torch.device, ranks: RankGroup) -> None:
        self.device = device  # where the collective's tensor lives (the backend's device)
        self.ranks = ranks

    def check(self, sig: int, describe: Callable[[], str]) -> None:
        """Raises InvalidStateError on every rank when the ranks' ``sig``
        differ; ``describe()`` says what this rank was about to run."""
        both = torch.tensor([sig, -sig], dtype=torch.int64, device=self.device)
        comm.all_reduce_max(both, group=self.ranks.group)
        if int(both[0]) == -int(both[1]):
            return
        # Every rank got the same maxima, so every rank is here: safe to gather.
        running = comm.all_gather_objects(describe(), group=self.ranks.group)
        listed = "; ".join(f"rank {r}: {what}" for r, what in enumerate(running))
        raise InvalidStateError(
            f"ZeRO-3 ranks diverged: they are about to gather different parameters ({listed}). "
            "Parameters are gathered with collectives, so every rank must run "
            "the same modules in the same order: make a data-dependent choice the same on every "
            "rank (e.g. all_reduce its condition), or run the module on every rank and discard "
            "its output where it is not wanted; where ranks choose among parts of one module "
            "(mixture-of-experts routing), mark that module a leaf, gathered whole: "
            "zcore.set_z3_leaf_modules(model, [ItsClass]) before zcore.initialize",
            running=running,
        )


class ReleasedParameterCheck(TorchFunctionMode):
    """While active, an operator given a zcore parameter that is not gathered
    has it declared as an external parameter of the module whose forward
    runs the operator (gathered now, and whenever that module runs), as
    DeepSpeed does; outside any module's forward it raises an error naming
    the parameter, instead of failing on its empty placeholder."""

    def __init__(
        self,
        released: Callable[[torch.Tensor], bool],
        describe_param: Callable[[torch.Tensor], str],
        describe_module: Callable[[Optional[torch.nn.Module]], str],
        adopt: Callable[[torch.nn.Parameter, torch.nn.Module], bool],
    ) -> None:
        """``adopt(param, module)``: declares the use; whether ``param`` is gathered now."""
        super().__init__()
        self._released = released  # whether a tensor is a zcore parameter not gathered now
        self._describe_param = describe_param  # its name and shape
        self._describe_module = describe_module  # None: the innermost running hooked module
        self._adopt = adopt

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None):
        kwargs = kwargs or {}
        # Attribute access (p.dtype, p.data = ...) reads no values: zcore's own
        # hooks and user code may do it on released parameters.
        if getattr(func, "__name__", "") not in ("__get__", "__set__"):
            for value in (*args, *kwargs.values()):
                for t in value if isinstance(value, (list, tuple)) else (value,):
                    if isinstance(t, torch.nn.Parameter) and self._released(t):
                        user = _calling_module()
                        if user is None or not self._adopt(t, user):
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
