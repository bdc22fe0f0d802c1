"""Host memory owned by zcore, handed to torch without copies.

torch cannot pin memory on a machine without CUDA, and O_DIRECT I/O needs
aligned buffers; zcore allocates host memory natively (aligned, optionally
locked with mlock) within an explicit byte budget, and exposes it as tensors
that share the native buffer and keep it alive.
"""

from __future__ import annotations

from typing import Literal

import torch

import zcore._C as _C
from zcore import arguments
from zcore.errors import InvalidArgumentError

LockMode = Literal["none", "try", "require"]

_LOCK_POLICIES = {
    "none": _C.LockPolicy.NONE,
    "try": _C.LockPolicy.TRY,
    "require": _C.LockPolicy.REQUIRE,
}

PAGE_ALIGNMENT = 4096
_POINTER_BYTES = 8  # posix_memalign's least alignment: sizeof(void*)


class HostMemory:
    """Aligned host buffers counted against ``budget`` bytes.

    ``lock``: ``"none"`` (pageable), ``"try"`` (mlock where RLIMIT_MEMLOCK
    permits, else pageable) or ``"require"`` (mlock or raise).
    Exceeding the budget raises :class:`zcore.HostMemoryBudgetError`.
    """

    def __init__(self, budget: int, lock: LockMode = "none") -> None:
        if lock not in _LOCK_POLICIES:
            raise InvalidArgumentError(
                f"lock must be one of {sorted(_LOCK_POLICIES)}, got {lock!r}", lock=lock
            )
        self._native = _C.HostMemory(budget, _LOCK_POLICIES[lock])

    def buffer(self, nbytes: int, alignment: int = PAGE_ALIGNMENT) -> _C.HostBuffer:
        """A zero-filled native buffer of ``nbytes``, aligned to ``alignment``
        bytes (a power of two)."""
        return self._native.allocate(nbytes, max(arguments.alignment(alignment), _POINTER_BYTES))

    def zeros(
        self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, alignment: int = PAGE_ALIGNMENT
    ) -> torch.Tensor:
        """A zero-filled CPU tensor backed by native memory from this budget.

        The tensor keeps its buffer alive; the bytes return to the budget when
        the last tensor viewing them is gone.
        """
        dtype = arguments.dtype(dtype, "dtype")
        shape, nbytes = arguments.shape(shape, dtype, "host tensor")
        return as_tensor(self.buffer(nbytes, alignment)).view(dtype).view(shape)

    @property
    def budget(self) -> int:
        return self._native.stats().budget

    def stats(self) -> _C.HostMemoryStats:
        """The budget, the bytes held and locked (pinned), and the peak."""
        return self._native.stats()


def as_tensor(buffer: _C.HostBuffer) -> torch.Tensor:
    """A 1-D uint8 CPU tensor over ``buffer`` (shares its memory, keeps it alive)."""
    return torch.frombuffer(buffer, dtype=torch.uint8)
