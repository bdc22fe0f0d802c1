"""Asynchronous reads and writes of tensors to files (NVMe offload).

The native engine keeps ``queue_depth`` blocks of ``block_size`` bytes in
flight on each of ``threads`` workers, with libaio and O_DIRECT where the
filesystem allows it and pread/pwrite on a thread pool elsewhere
(:attr:`AioEngine.backend` says which, :attr:`AioEngine.backend_reason` why).
Any size, offset and buffer alignment is accepted; unaligned parts go through
bounce buffers transparently.

CPU tensors are read and written in place: keep them alive and untouched
until the handle is waited for. CUDA tensors are staged through host buffers
from a pool bounded by ``staging_budget`` (a pwrite copies the tensor to the
host before it returns; a pread copies to the device in ``wait()``).

Failures raise :class:`zcore.DiskFullError`, :class:`zcore.DiskIOError`,
:class:`zcore.ShortReadError` (from ``wait()``) or
:class:`zcore.FileTooSmallError` (from ``pread``), with ``path``, ``offset``
and ``errno`` attributes; a full disk (ENOSPC) also names the bytes the
request needs (``required``) and those free on the filesystem when it
failed (``available``).
"""

from __future__ import annotations

import os
from typing import Callable

import torch

import zcore._C as _C
from zcore.memory.staging import (
    BackendName,
    Staging,
    as_bytes,
    backend_name,
    check_tensor,
    io_config,
    make_pool,
    nbytes,
)
from zcore.errors import InvalidArgumentError, InvalidHandleError
from zcore.memory.host_memory import LockMode

_MAX_OFFSET = 2**63 - 1  # the native engine's int64; it refuses requests ending past its own limit


def _file_offset(offset: object) -> int:
    # A bool is an int to Python, and an int past int64 would reach the
    # binding as a raw TypeError: both are refused here with the value.
    if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset <= _MAX_OFFSET:
        raise InvalidArgumentError(
            f"offset must be an int in [0, 2**63), got {offset!r}", offset=offset
        )
    return offset


class IoHandle:
    """A pending :meth:`AioEngine.pread` or :meth:`AioEngine.pwrite`."""

    def __init__(
        self,
        engine: AioEngine,
        native: int,
        tensor: torch.Tensor,
        staging: Staging | None,
        finish: Callable[[], None] | None,
    ) -> None:
        self._engine = engine
        self._native = native
        # Referenced until the I/O is over: the kernel reads or writes them.
        self._tensor: torch.Tensor | None = tensor
        self._staging = staging
        self._finish = finish

    def poll(self) -> bool:
        """True once the request has finished (``wait()`` then returns at once)."""
        return self._tensor is None or self._engine._native.poll(self._native)

    def wait(self) -> torch.Tensor:
        """Waits for the request (GIL released), raises its error, and returns the tensor."""
        tensor = self._tensor
        if tensor is None:
            raise InvalidHandleError(
                f"I/O handle {self._native} was already waited for", handle=self._native
            )
        try:
            self._engine._native.wait(self._native)
            if self._finish is not None:
                self._finish()
        finally:
            self._tensor = None
            self._staging = None
            self._finish = None
            self._engine._pending.pop(self._native, None)
        return tensor


class AioEngine:
    """Asynchronous tensor I/O on files.

    ``directory``: where the files will be (decides whether O_DIRECT can be
    used there when ``backend="auto"``). ``block_size`` must be a multiple of
    4096 bytes. ``staging_budget`` bounds the host memory used to stage CUDA
    tensors.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        block_size: int = 1 << 20,
        queue_depth: int = 32,
        threads: int = 1,
        backend: BackendName = "auto",
        staging_budget: int = 256 << 20,
        lock: LockMode = "try",
    ) -> None:
        config = io_config(
            block_size=block_size,
            queue_depth=queue_depth,
            threads=threads,
            backend=backend,
            directory=os.fspath(directory) if directory is not None else "",
        )
        self._native = _C.AioEngine(config)
        self._staging_budget = staging_budget
        self._lock: LockMode = lock
        self._pool: _C.HostBufferPool | None = None
        self._pending: dict[int, IoHandle] = {}

    @property
    def backend(self) -> str:
        """``"libaio"`` or ``"threadpool"``."""
        return backend_name(self._native.backend)

    @property
    def backend_reason(self) -> str:
        return self._native.backend_reason

    @property
    def config(self) -> _C.AioConfig:
        return self._native.config

    def stats(self) -> _C.AioStats:
        """Requests, bytes read and written, and the bytes that went through bounce buffers or the page cache."""
        return self._native.stats()

    def pwrite(
        self, tensor: torch.Tensor, path: str | os.PathLike[str], offset: int = 0
    ) -> IoHandle:
        """Starts writing the bytes of ``tensor`` to ``path`` at ``offset``
        (the file is created if needed, never truncated)."""
        check_tensor(tensor, "pwrite")
        offset = _file_offset(offset)
        size = nbytes(tensor)
        staging = None
        address = tensor.data_ptr()
        if tensor.device.type == "cuda":
            staging = Staging(self._staging_pool(), size)
            staging.bytes.copy_(as_bytes(tensor))
            address = staging.address
        native = self._native.submit(True, address, size, os.fspath(path), offset)
        return self._track(IoHandle(self, native, tensor, staging, None))

    def pread(
        self, tensor: torch.Tensor, path: str | os.PathLike[str], offset: int = 0
    ) -> IoHandle:
        """Starts reading ``tensor.nbytes`` bytes at ``offset`` of ``path`` into ``tensor``."""
        check_tensor(tensor, "pread")
        offset = _file_offset(offset)
        size = nbytes(tensor)
        if tensor.device.type != "cuda":
            native = self._native.submit(False, tensor.data_ptr(), size, os.fspath(path), offset)
            return self._track(IoHandle(self, native, tensor, None, None))
        staging = Staging(self._staging_pool(), size)
        native = self._native.submit(False, staging.address, size, os.fspath(path), offset)

        def to_device() -> None:
            as_bytes(tensor).copy_(staging.bytes)

        return self._track(IoHandle(self, native, tensor, staging, to_device))

    def wait_all(self) -> None:
        """Waits for every pending request; raises the first failure after all finished."""
        first: BaseException | None = None
        for handle in sorted(self._pending.values(), key=lambda h: h._native):
            try:
                handle.wait()
            except Exception as exc:  # noqa: BLE001 - re-raised below once all are done
                first = first or exc
        if first is not None:
            raise first

    @property
    def pending(self) -> int:
        return len(self._pending)

    def _track(self, handle: IoHandle) -> IoHandle:
        self._pending[handle._native] = handle
        return handle

    def _staging_pool(self) -> _C.HostBufferPool:
        if self._pool is None:
            self._pool = make_pool(self._staging_budget, self._lock)
        return self._pool

    def __del__(self) -> None:
        # Tensors of unfinished requests must outlive the kernel's use of them.
        pending = getattr(self, "_pending", None)
        if pending:
            for handle in list(pending.values()):
                try:
                    handle.wait()
                except Exception:  # noqa: BLE001 - nobody left to report to
                    pass
