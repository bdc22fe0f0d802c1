"""Where parameters live between uses, as the engine sees it: whole on every
rank (stages 0-2, ``ResidentParams``), or sharded and gathered for each
module call (stage 3, zcore.zero3.param_fetcher.ParamFetcher)."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from zcore.step.sharded_optimizer import Publisher
from zcore.step.units import FlatUnit


class ParamResidency(Protocol):
    """Where parameters live between uses: ``ResidentParams`` (stages 0-2)
    or zcore.zero3.param_fetcher.ParamFetcher (stage 3, gathered on demand)."""

    def forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any: ...

    def after_backward(self) -> None:
        """After the backward that may end a step."""

    def before_update(self) -> None:
        """Before the optimizer updates the parameters."""

    def abort(self) -> None:
        """After an exception in forward or backward."""

    def abort_after(self, exc: BaseException) -> None:
        """``abort``, whose own failure is noted on ``exc`` rather than raised."""

    def stats(self) -> Any: ...

    def stored_tensors(self) -> list[torch.Tensor]:
        """What holds parameters between uses (the memory report's parameter
        bytes in stages 0-2; in stage 3 it asks the fetcher, tier by tier)."""

    def reload(self) -> None:
        """After a checkpoint load replaced the shards: parameters take them."""

    def close(self) -> None:
        """Releases what parameters rest in outside memory (swap files)."""


class ResidentParams:
    """Stages 0-2: every rank holds whole parameters; nothing to do between uses."""

    def __init__(self, units: list[FlatUnit], publisher: Publisher) -> None:
        self.units = units
        self._publisher = publisher

    def reload(self) -> None:
        self._publisher.publish()

    def stored_tensors(self) -> list[torch.Tensor]:
        return [u.flat for u in self.units]

    def close(self) -> None:
        return None

    def forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        return module(*args, **kwargs)

    def after_backward(self) -> None:
        return None

    def before_update(self) -> None:
        return None

    def abort(self) -> None:
        return None

    def abort_after(self, exc: BaseException) -> None:
        return None

    def stats(self) -> None:
        return None
