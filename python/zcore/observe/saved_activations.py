"""The bytes autograd keeps for backward during a forward: the activations
of the step metrics (zcore.observe.step_metrics).

Counted in a saved-tensor pack hook, each storage once (a saved view keeps
its whole storage alive; a storage freed since, as the user's pack hook may
free what it replaces, lets a new one take its address), without the
parameters' storages: stages 0-2
parameters view their flat unit, and in stage 3 zcore's own hooks keep
parameters and their views from reaching this one. The user's saved-tensor
hooks in force around ``engine(x)`` still apply: every tensor goes on to
their pack (zcore.zero3.saved_views).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

import weakref

import torch

from zcore.zero3.saved_views import UserPacked, hooks_in_force


class SavedActivations:
    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module
        self._parameters: set[int] = set()  # storage addresses
        self._seen: dict[int, weakref.ref] = {}  # storage address -> the storage counted there
        self._outer: Optional[tuple[Any, Any]] = None
        self.bytes = 0  # the current (or last) forward's
        self.peak = 0  # the largest forward's since ``reset``

    @contextmanager
    def counting(self) -> Iterator[None]:
        """Counts what the forward within saves."""
        self._parameters = {p.untyped_storage().data_ptr() for p in self._module.parameters()}
        self._seen.clear()
        self.bytes = 0
        self._outer = hooks_in_force()
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._outer = None
            self._seen.clear()
            self.peak = max(self.peak, self.bytes)

    def reset(self) -> None:
        self.peak = 0

    def _pack(self, t: torch.Tensor) -> Any:
        if t.layout == torch.strided and not isinstance(t, torch.nn.Parameter):
            storage = t.untyped_storage()
            address = storage.data_ptr()
            counted = self._seen.get(address)
            if address not in self._parameters and (counted is None or counted() is None):
                self._seen[address] = weakref.ref(storage)
                self.bytes += storage.nbytes()
        if self._outer is None:
            return t
        pack, unpack = self._outer
        return UserPacked(pack(t), unpack)

    def _unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, UserPacked):
            return saved.unpack(saved.packed)
        return saved
