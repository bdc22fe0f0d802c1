"""ZeRO-3: tensors autograd saves that view gathered buffers (note "saved views").

Autograd saves views of parameters for backward (``weight.t()`` of a
Linear). Such a view aliases the gathered buffer, which is released after
the module and reused for another group, so the engine's forward runs under
these saved-tensor hooks: a saved tensor that views a gathered buffer is
kept as (group, offset, size, stride) and rebuilt from the group's buffer of
the moment at backward, when the module's backward pre-hook has gathered the
group again. Arena compaction moves buffers the same way, which is why
nothing else may keep a view across a gather.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from zcore.errors import InvalidStateError
from zcore.gather_buffers import GatherBuffers


class _SavedView(NamedTuple):
    group: int
    offset: int
    size: torch.Size
    stride: tuple[int, ...]


class SavedViews:
    """``pack`` and ``unpack`` for torch.autograd.graph.saved_tensors_hooks."""

    def __init__(
        self,
        buffers: GatherBuffers,
        group_of_param: dict[int, int],
        gathered: Callable[[int], bool],
        shapes_of: Callable[[int], str],
    ) -> None:
        self._buffers = buffers
        self._group_of_param = group_of_param
        self._gathered = gathered  # whether a group's buffer holds its parameters now
        self._shapes_of = shapes_of  # a group's parameter shapes, for errors

    def pack(self, t: torch.Tensor) -> Any:
        if t.layout != torch.strided or id(t) in self._group_of_param:
            return t  # a parameter saved as itself: its .data follows the gathers
        owner = self._buffers.owner_of(t)
        if owner is None:
            return t
        return _SavedView(owner[0], owner[1], t.shape, t.stride())

    def unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _SavedView):
            return saved
        if not self._gathered(saved.group):
            raise InvalidStateError(
                f"backward needs parameter group {saved.group} (parameters "
                f"{self._shapes_of(saved.group)}) but it is not gathered: a module used a "
                "parameter it does not own; declare it with "
                "zcore.register_external_parameter(module, param)",
                group=saved.group,
            )
        full = self._buffers.current(saved.group)
        # as_strided's offset counts from the start of the storage, not of ``full``.
        return full.as_strided(saved.size, saved.stride, full.storage_offset() + saved.offset)
