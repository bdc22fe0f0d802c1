"""Tensors as byte ranges for the native I/O, and host staging buffers.

Shared by :mod:`zcore.memory.aio` and :mod:`zcore.memory.swap`: the native side sees only
host addresses and byte counts, so CPU tensors are passed by address and CUDA
tensors go through host staging buffers from a :class:`_C.HostBufferPool`
(registered with CUDA when a GPU is present, so the copies run by DMA).
"""

from __future__ import annotations

from typing import Literal

import torch

import zcore._C as _C
from zcore.errors import InvalidArgumentError
from zcore.memory.host_memory import _LOCK_POLICIES, LockMode
from zcore.runtime import cuda_available

BackendName = Literal["auto", "libaio", "threadpool"]

_BACKENDS = {
    "auto": _C.IoBackend.AUTO,
    "libaio": _C.IoBackend.LIBAIO,
    "threadpool": _C.IoBackend.THREADPOOL,
}


def io_config(
    *, block_size: int, queue_depth: int, threads: int, backend: BackendName, directory: str = ""
) -> _C.AioConfig:
    """A native engine config; the native side validates the numbers."""
    if backend not in _BACKENDS:
        raise InvalidArgumentError(
            f"backend must be one of {sorted(_BACKENDS)}, got {backend!r}", backend=backend
        )
    config = _C.AioConfig()
    config.block_size = block_size
    config.queue_depth = queue_depth
    config.threads = threads
    config.backend = _BACKENDS[backend]
    config.probe_directory = directory
    return config


def backend_name(backend: _C.IoBackend) -> str:
    return backend.name.lower()


def check_tensor(tensor: torch.Tensor, what: str) -> None:
    """Raises unless ``tensor`` is a non-empty contiguous CPU or CUDA tensor."""
    if not isinstance(tensor, torch.Tensor):
        raise InvalidArgumentError(f"{what} needs a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(
            f"{what} supports CPU and CUDA tensors, got device={tensor.device}"
        )
    if not tensor.is_contiguous():
        raise InvalidArgumentError(
            f"{what} needs a contiguous tensor (shape={tuple(tensor.shape)}, "
            f"stride={tensor.stride()}); pass tensor.contiguous()"
        )
    if tensor.numel() == 0:
        raise InvalidArgumentError(f"{what} needs a tensor with at least one element")


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The contiguous ``tensor`` as a flat uint8 view (no copy)."""
    return tensor.reshape(-1).view(torch.uint8)


def make_pool(budget: int, lock: LockMode) -> _C.HostBufferPool:
    """A staging pool, registered with CUDA when a GPU can be used."""
    if lock not in _LOCK_POLICIES:
        raise InvalidArgumentError(
            f"lock must be one of {sorted(_LOCK_POLICIES)}, got {lock!r}", lock=lock
        )
    registrar = _C.CudaHostRegistrar() if cuda_available() else None
    return _C.HostBufferPool(budget, _LOCK_POLICIES[lock], registrar)


PAGE = 4096


def page_placed(nbytes: int, offset: int = 0) -> torch.Tensor:
    """``nbytes`` bytes whose address equals ``offset`` modulo the page
    size: O_DIRECT moves a file's bytes at ``offset`` straight into or out
    of them, without the engine's bounce buffers."""
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
    shift = (offset - raw.data_ptr()) % PAGE
    return raw[shift : shift + nbytes]


class Staging:
    """A pool buffer holding the bytes of one tensor on the host."""

    def __init__(self, pool: _C.HostBufferPool, size: int) -> None:
        self.buffer = pool.acquire(size)
        self.bytes = torch.frombuffer(self.buffer, dtype=torch.uint8)[:size]

    @property
    def address(self) -> int:
        return self.buffer.address

    def typed(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """The staged bytes viewed as a tensor (keeps the buffer alive)."""
        return self.bytes.view(dtype).view(shape)
