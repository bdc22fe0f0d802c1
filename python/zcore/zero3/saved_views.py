"""ZeRO-3: tensors autograd saves that view gathered buffers (note "saved views").

Autograd saves views of parameters for backward (``weight.t()`` of a
Linear). Such a view aliases the gathered buffer, which is released after
the module and reused for another group, so the engine's forward runs under
these saved-tensor hooks: a saved tensor that views a gathered buffer is
kept as (group, offset, size, stride) and rebuilt from the group's buffer of
the moment at backward, when the module's backward pre-hook has gathered the
group again. Arena compaction moves buffers the same way, which is why
nothing else may keep a view across a gather.

The user's own saved-tensor hooks around ``engine(x)`` (``save_on_cpu()``,
their own pack and unpack) compose with these: zcore's pushed on top would
otherwise shadow them, since autograd calls only the innermost pair. Every
saved tensor that is not a parameter or a view of a gathered buffer goes
through the user's pack, and comes back through their unpack; parameters
and their views stay zcore's (they are re-gathered for backward, not
stored). torch offers no public way to read the hooks in force, so they are
read with ``torch._C._autograd._top_saved_tensors_default_hooks``; a torch
that changes it fails the activation tests at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Callable, NamedTuple, Optional

import torch

from zcore.errors import InvalidStateError
from zcore.parallel.dtensor import dtensor, is_dtensor
from zcore.zero3.gather_buffers import GatherBuffers


class _SavedView(NamedTuple):
    group: int
    offset: int
    size: torch.Size
    stride: tuple[int, ...]


class _SavedDTensorView(NamedTuple):
    """A DTensor (tensor parallelism) whose local tensor views a gathered buffer."""

    local: _SavedView
    spec: Any  # the DTensor's placement and global shape
    requires_grad: bool


class UserPacked(NamedTuple):
    """What the user's pack hook returned, with the unpack that reverses it."""

    packed: Any
    unpack: Callable[[Any], torch.Tensor]


def hooks_in_force() -> Optional[tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]]:
    """The (pack, unpack) pair autograd would use now, if any."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


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
        self._outer: Optional[tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]] = None

    @contextlib.contextmanager
    def composed_with(self, outer: Optional[tuple[Callable, Callable]]) -> Iterator[None]:
        """Within it, tensors zcore does not relocate go through ``outer``'s pack."""
        self._outer = outer
        try:
            yield
        finally:
            self._outer = None

    def pack(self, t: torch.Tensor) -> Any:
        if id(t) in self._group_of_param:
            return t  # a parameter saved as itself: its .data follows the gathers
        if is_dtensor(t):  # its values are its local tensor's (zcore.parallel.mesh)
            local = self._view_of(t._local_tensor)
            if local is not None:
                return _SavedDTensorView(local, t._spec, t.requires_grad)
        else:
            view = self._view_of(t)
            if view is not None:
                return view
        if self._outer is None:
            return t
        pack, unpack = self._outer
        return UserPacked(pack(t), unpack)

    def _view_of(self, t: torch.Tensor) -> Optional[_SavedView]:
        owner = self._buffers.owner_of(t) if t.layout == torch.strided else None
        return None if owner is None else _SavedView(owner[0], owner[1], t.shape, t.stride())

    def unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, UserPacked):
            return saved.unpack(saved.packed)
        if isinstance(saved, _SavedDTensorView):
            return dtensor(self._rebuilt(saved.local), saved.spec, saved.requires_grad)
        if not isinstance(saved, _SavedView):
            return saved
        return self._rebuilt(saved)

    def _rebuilt(self, saved: _SavedView) -> torch.Tensor:
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
