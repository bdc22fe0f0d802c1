"""Swapping tensors out to NVMe and back, by key.

The native swap manager owns one swap file under ``directory``, the extent of
each key inside it, and the asynchronous I/O; this module holds the tensors.
Keys are integers chosen by the caller.

Pipelined use (at most three tensors in host memory: the one in use, the
next one being read, the previous one being written)::

    with zcore.memory.swap.SwapManager(directory, capacity=8 << 30, name="optimizer") as swap:
        for key, tensor in swap.stream(keys):   # tensors swapped out before
            update(tensor)                      # written back after the step

Swapped-in CPU tensors live in buffers of a host pool bounded by
``host_budget`` (aligned, so their I/O takes the O_DIRECT path without
bounce copies); CUDA tensors are staged through the same pool.

Every rank of every job may be given the same ``directory`` (also over a
shared filesystem), and one process may hold several managers there: each
has its own file, ``zcore-swap-<name>-rank<R>-<host>-<pid>-<random>.swp``,
locked (``flock``) while the manager lives. The constructor removes the
leftovers of killed runs, swap files whose lock nobody holds, logs one warning
on the ``zcore`` logger saying how many files and bytes it removed
(``leftovers_removed`` lists them), and leaves live managers' files, symlinks,
directories and other names alone. A directory shared between hosts needs a
filesystem whose locks all hosts see (NFS with its lock manager, Lustre with
``-o flock``); a filesystem that refuses ``flock`` is a
:class:`zcore.DiskIOError`.

The constructor refuses, before any training, a directory it cannot write
(:class:`zcore.DiskIOError`) or one whose filesystem has less than
``capacity`` bytes free once leftovers are removed
(:class:`zcore.DiskFullError`). Where the directory refuses O_DIRECT (ramfs;
tmpfs before Linux 6.6), the swap file's I/O goes through the page cache and
the constructor says so in one INFO line on the ``zcore`` logger. ``close()``
(or leaving the ``with`` block) removes the swap file.

The file is not preallocated: it grows as keys are first written. A
swap-out that needs new blocks on a disk that filled up since (or any
overwrite on a copy-on-write filesystem) fails its ``wait`` with
:class:`zcore.DiskFullError` naming the file, the bytes the write needs
(``required``) and those free (``available``). A failed swap-out forgets
the key (the bytes it had on disk are lost): a later ``swap_in`` of it
raises that failure again, naming the key.

The swap file is checked to be the one created (device and inode) before
each I/O and after it: if it was deleted (a tmp cleaner) or replaced,
:class:`zcore.SwapFileLostError` says so, instead of a swap-in returning
zeros or another file's bytes. What was swapped out is then gone: every later
call but ``close()`` raises the same error, and ``close()`` leaves a file
that is not the manager's own in place. Bytes changed in place (another
writer, a disk returning other data) fail the swap-in's ``wait`` with
:class:`zcore.SwapCorruptedError`: each swap-out records an XXH3 checksum.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Callable

import torch

import zcore._C as _C
from zcore import tracing
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
from zcore.errors import InvalidArgumentError, ZcoreError
from zcore.memory.host_memory import LockMode
from zcore.tracing import Wait

log = logging.getLogger("zcore")


@dataclass(frozen=True)
class _Layout:
    """What a key's bytes are, to rebuild its tensor on swap-in."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device


@dataclass
class _InFlight:
    """References the native I/O of a key is using, released by wait()."""

    tensor: torch.Tensor
    staging: Staging | None
    finish: Callable[[], None] | None
    writing: bool  # a swap-out: the native manager drops the key if it fails


@dataclass(frozen=True)
class _FailedSwapOut:
    """Why a key was forgotten (its swap-out failed), without the traceback
    and the tensors it references."""

    error: type[ZcoreError]
    message: str
    details: dict

    def again(self, key: int) -> ZcoreError:
        return self.error(
            f"key {key} cannot be swapped in: its swap-out failed, so its bytes are lost ({self.message})",
            **{**self.details, "key": key},
        )


def _log_leftovers(native: _C.SwapManager, directory: str) -> None:
    removed = native.leftovers_removed
    if removed:
        log.warning(
            "removed %d leftover swap file(s) of killed runs (%d bytes) from %s",
            len(removed),
            native.stats().leftover_bytes_removed,
            directory,
        )


def _log_page_cache(native: _C.SwapManager, directory: str, backend: BackendName) -> None:
    if backend != "auto" or native.backend != _C.IoBackend.THREADPOOL:
        return
    why = (
        f"the filesystem of {directory} refuses O_DIRECT, or libaio cannot be set up"
        if _C.libaio_compiled()
        else "this build of zcore has no libaio"
    )
    log.info("swap file %s: I/O goes through the page cache, not O_DIRECT (%s)", native.path, why)


def _default_rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


class SwapManager:
    """Swap space of ``capacity`` bytes for this rank under ``directory``.

    ``name`` ([A-Za-z0-9_], may be empty) goes into the file name to say what
    the file holds (``"params"``, ``"optimizer"``).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        capacity: int,
        *,
        rank: int | None = None,
        name: str = "",
        host_budget: int = 1 << 30,
        block_size: int = 1 << 20,
        queue_depth: int = 32,
        threads: int = 1,
        backend: BackendName = "auto",
        lock: LockMode = "try",
    ) -> None:
        config = _C.SwapConfig()
        config.directory = os.fspath(directory)
        config.rank = _default_rank() if rank is None else rank
        config.capacity = capacity
        config.name = name
        config.io = io_config(
            block_size=block_size, queue_depth=queue_depth, threads=threads, backend=backend
        )
        self._pool = make_pool(host_budget, lock)
        self._native = _C.SwapManager(config)
        # Closed (the swap file removed) by close(), when collected, or at
        # interpreter exit, whichever comes first.
        self._finalizer = weakref.finalize(self, self._native.close)
        self._layouts: dict[int, _Layout] = {}
        self._in_flight: dict[int, _InFlight] = {}
        self._failed: dict[int, _FailedSwapOut] = {}  # keys forgotten because their swap-out failed
        _log_leftovers(self._native, config.directory)
        _log_page_cache(self._native, config.directory, backend)

    @property
    def path(self) -> str:
        """The swap file of this manager."""
        return self._native.path

    @property
    def leftovers_removed(self) -> list[str]:
        """Swap files of dead processes that the constructor removed."""
        return self._native.leftovers_removed

    @property
    def backend(self) -> str:
        return backend_name(self._native.backend)

    def stats(self) -> _C.SwapStats:
        """The file's capacity and use, its entries, and the bytes swapped out and in."""
        return self._native.stats()

    def __contains__(self, key: int) -> bool:
        return self._native.contains(key)

    def state(self, key: int) -> _C.SwapState:
        """Where tensor ``key``'s swap is: being written, on disk, or being read back."""
        return self._native.state(key)

    def extent(self, key: int) -> _C.SwapExtent:
        """Where the bytes of ``key`` lie in the swap file (offset, bytes)."""
        return self._native.extent(key)

    def swap_out(self, key: int, tensor: torch.Tensor) -> None:
        """Starts writing ``tensor`` to the swap space of ``key``.

        A CPU tensor is written in place: leave it untouched until
        ``wait(key)``. A CUDA tensor is copied to a staging buffer first.
        """
        check_tensor(tensor, "swap_out")
        size = nbytes(tensor)
        staging = None
        address = tensor.data_ptr()
        if tensor.device.type == "cuda":
            staging = Staging(self._pool, size)
            with tracing.waiting(Wait.COPY):
                staging.bytes.copy_(as_bytes(tensor))
            address = staging.address
        with tracing.span("nvme_write"):
            self._native.swap_out(key, address, size)
        self._layouts[key] = _Layout(tensor.shape, tensor.dtype, tensor.device)
        self._in_flight[key] = _InFlight(tensor, staging, None, writing=True)
        self._failed.pop(key, None)

    def swap_in(self, key: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Starts reading ``key`` back; returns the tensor being filled.

        The tensor is valid after ``wait(key)``. Without ``out``, it is made on
        the device the key was swapped out from (on the host, in a pool buffer).
        """
        layout = self._layouts.get(key)
        if layout is None:
            failed = self._failed.get(key)
            if failed is not None:
                raise failed.again(key)
            raise InvalidArgumentError(f"key {key} is not swapped out; swap it out first", key=key)
        if out is None:
            out = self._new_tensor(layout)
        check_tensor(out, "swap_in")
        if out.shape != layout.shape or out.dtype != layout.dtype:
            raise InvalidArgumentError(
                f"swap_in of key {key} needs shape={tuple(layout.shape)}, dtype={layout.dtype}; "
                f"got shape={tuple(out.shape)}, dtype={out.dtype}",
                key=key,
            )
        size = nbytes(out)
        if out.device.type != "cuda":
            with tracing.span("nvme_read"):
                self._native.swap_in(key, out.data_ptr(), size)
            self._in_flight[key] = _InFlight(out, None, None, writing=False)
            return out
        staging = Staging(self._pool, size)
        with tracing.span("nvme_read"):
            self._native.swap_in(key, staging.address, size)
        target = out

        def to_device() -> None:
            as_bytes(target).copy_(staging.bytes)

        self._in_flight[key] = _InFlight(out, staging, to_device, writing=False)
        return out

    def poll(self, key: int) -> bool:
        """True when ``key`` has no I/O in flight."""
        return self._native.poll(key)

    def wait(self, key: int) -> None:
        """Waits for the I/O of ``key`` (GIL released) and raises its error.

        A failed swap-out forgets the key (what was on disk before is lost;
        a later ``swap_in`` of it raises the failure again); other keys are
        unaffected.
        """
        flight = self._in_flight.pop(key, None)
        try:
            with tracing.waiting(Wait.NVME):
                self._native.wait(key)
        except ZcoreError as exc:
            if flight is not None and flight.writing:
                # The native manager dropped the key: its extent holds partial bytes.
                self._layouts.pop(key, None)
                self._failed[key] = _FailedSwapOut(type(exc), str(exc), dict(exc.details))
            raise
        if flight is not None and flight.finish is not None:
            with tracing.waiting(Wait.COPY):
                flight.finish()

    def wait_all(self) -> None:
        """Waits for every key; raises the first failure after all finished."""
        first: BaseException | None = None
        for key in sorted(self._in_flight):
            try:
                self.wait(key)
            except Exception as exc:  # noqa: BLE001 - re-raised below once all are done
                first = first or exc
        if first is not None:
            raise first

    def release(self, key: int) -> None:
        """Forgets ``key`` and frees its swap space for reuse."""
        if self._failed.pop(key, None) is not None:
            return  # the native manager already forgot it
        self._native.release(key)
        self._layouts.pop(key, None)

    def stream(
        self,
        keys: Iterable[int],
        *,
        write_back: bool = True,
        read_ahead: bool = True,
        write_behind: bool = True,
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """Yields ``(key, tensor)`` for each key in order, swapped in.

        With ``read_ahead`` the next key is read while the caller uses the
        current one (else once the caller is done with it). With
        ``write_back`` each tensor is swapped out again once the caller moves
        on; with ``write_behind`` that write is waited for only after the
        next key has been used (else at once). At most three tensors are in
        host memory: one more than the one in use for each overlap.
        """
        order = list(keys)
        if not order:
            return
        incoming = {order[0]: self.swap_in(order[0])}
        try:
            for i, key in enumerate(order):
                following = order[i + 1] if i + 1 < len(order) else None
                if read_ahead and following is not None:
                    incoming[following] = self.swap_in(following)
                self.wait(key)
                tensor = incoming.pop(key)
                yield key, tensor
                if write_back:
                    self.swap_out(key, tensor)
                    if not write_behind:
                        self.wait(key)
                    elif i > 0:
                        self.wait(order[i - 1])
                del tensor
                if not read_ahead and following is not None:
                    incoming[following] = self.swap_in(following)
        finally:
            self.wait_all()

    def close(self) -> None:
        """Waits for pending I/O and removes the swap file."""
        self._finalizer()
        self._in_flight.clear()
        self._layouts.clear()
        self._failed.clear()

    def __enter__(self) -> SwapManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _new_tensor(self, layout: _Layout) -> torch.Tensor:
        if layout.device.type == "cuda":
            return torch.empty(layout.shape, dtype=layout.dtype, device=layout.device)
        size = layout.shape.numel() * torch.empty((), dtype=layout.dtype).element_size()
        return Staging(self._pool, size).typed(layout.shape, layout.dtype)
