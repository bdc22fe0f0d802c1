"""Typed tensors carved out of one preallocated byte arena.

The native ContiguousAllocator decides where each block lives (best fit,
coalescing, compaction); this module owns the torch tensor that holds the
bytes and turns blocks into typed views.

A view is valid until the arena next compacts: compaction moves blocks, and
``Arena.generation`` increments each time it does. Ask ``arena.tensor(block)``
again after any ``allocate`` or ``defragment`` instead of keeping views.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import zcore._C as _C
from zcore import arguments
from zcore.errors import CudaUnavailableError, InvalidArgumentError
from zcore.memory.host_memory import PAGE_ALIGNMENT, HostMemory, LockMode, as_tensor

DEFAULT_ALIGNMENT = 256  # CUDA's allocation granularity for vectorised access


@dataclass(frozen=True)
class Block:
    """A typed block of an arena: what to view, not where it is."""

    handle: int
    shape: torch.Size
    dtype: torch.dtype
    nbytes: int


class Arena:
    """Blocks of typed tensors inside ``storage``, a 1-D contiguous uint8 tensor.

    On a host tensor, bytes move with memmove; on a CUDA tensor, with copies
    ordered on ``stream`` (default: the device's current stream when the
    arena is made). Allocation compacts the arena by itself when enough bytes
    are free but no single free range fits.
    """

    def __init__(self, storage: torch.Tensor, *, stream: torch.cuda.Stream | None = None) -> None:
        _check_storage(storage)
        capacity = storage.numel()
        if storage.device.type == "cuda":
            if stream is None:
                stream = torch.cuda.current_stream(storage.device)
            self._native = _C.ContiguousAllocator.over_device(
                capacity, storage.data_ptr(), stream.cuda_stream
            )
        else:
            if stream is not None:
                raise InvalidArgumentError(
                    "stream applies to CUDA arenas only; drop it for a host arena"
                )
            self._native = _C.ContiguousAllocator.over_host(capacity, storage.data_ptr())
        self._storage = storage

    @classmethod
    def on_host(
        cls, capacity: int, *, lock: LockMode = "none", memory: HostMemory | None = None
    ) -> Arena:
        """An arena over ``capacity`` bytes of zcore-owned host memory.

        The bytes come from ``memory`` (and count against its budget) or from
        a new HostMemory with a budget of exactly ``capacity``.
        """
        if memory is None:
            memory = HostMemory(capacity, lock=lock)
        return cls(as_tensor(memory.buffer(capacity, PAGE_ALIGNMENT)))

    @classmethod
    def on_device(cls, capacity: int, device: torch.device | str | int | None = None) -> Arena:
        """An arena over ``capacity`` bytes of CUDA memory."""
        reason = _C.cuda_unavailable_reason()
        if reason:
            raise CudaUnavailableError(f"cannot create a device arena: {reason}")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return cls(torch.empty(capacity, dtype=torch.uint8, device=device))

    def allocate(
        self,
        shape: tuple[int, ...] | torch.Size,
        dtype: torch.dtype,
        alignment: int = DEFAULT_ALIGNMENT,
    ) -> Block:
        """Reserve a block for a tensor of ``shape`` and ``dtype``, at an
        offset that is a multiple of ``alignment`` bytes (a power of two;
        at least the element size).

        Raises :class:`zcore.OutOfArenaError` when it does not fit even after
        compaction, :class:`zcore.InvalidArgumentError` for a shape, dtype
        or alignment it cannot take. The block's bytes are not initialised.
        """
        dtype = arguments.dtype(dtype, "dtype")
        shape, nbytes = arguments.shape(shape, dtype, "arena block")
        align = arguments.alignment(alignment)
        handle = self._native.allocate(nbytes, max(align, dtype.itemsize))
        return Block(handle=handle, shape=shape, dtype=dtype, nbytes=nbytes)

    def free(self, block: Block) -> None:
        """Returns ``block``'s bytes to the arena (coalesced with free neighbours)."""
        self._native.free(block.handle)

    def tensor(self, block: Block) -> torch.Tensor:
        """A view of ``block`` at its current offset (re-derive after compaction)."""
        offset = self._native.offset(block.handle)
        raw = self._storage[offset : offset + block.nbytes]
        return raw.view(block.dtype).view(block.shape)

    def offset(self, block: Block) -> int:
        """The block's current byte offset in the arena (changes on compaction)."""
        return self._native.offset(block.handle)

    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t`` views this arena's bytes."""
        return t.untyped_storage().data_ptr() == self._storage.untyped_storage().data_ptr()

    def defragment(self) -> list[_C.Move]:
        """Compact live blocks towards the start; returns the moves made."""
        return self._native.defragment()

    def stats(self) -> _C.AllocatorStats:
        """Bytes used and free, the largest free block, fragmentation."""
        return self._native.stats()

    @property
    def generation(self) -> int:
        """Number of compactions that moved blocks so far."""
        return self._native.generation

    @property
    def capacity(self) -> int:
        return self._native.capacity

    @property
    def device(self) -> torch.device:
        return self._storage.device


def _check_storage(storage: torch.Tensor) -> None:
    if not isinstance(storage, torch.Tensor):
        raise InvalidArgumentError(
            f"arena storage must be a torch.Tensor, got {type(storage).__name__}"
        )
    if storage.dtype != torch.uint8 or storage.dim() != 1 or not storage.is_contiguous():
        raise InvalidArgumentError(
            f"arena storage must be a 1-D contiguous uint8 tensor, got dtype={storage.dtype}, "
            f"shape={tuple(storage.shape)}, contiguous={storage.is_contiguous()}; "
            "make one with torch.empty(capacity, dtype=torch.uint8, device=...)"
        )
    if storage.numel() == 0:
        raise InvalidArgumentError("arena storage is empty; give it at least one byte")
    if storage.device.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(
            f"arena storage must live on the CPU or a CUDA device, got device={storage.device}"
        )
