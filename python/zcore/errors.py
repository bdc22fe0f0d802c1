"""Exceptions raised by zcore.

Every native error arrives as one of these, chosen by its status code, with
the values the native side reported (requested bytes, free bytes, ...) as
attributes and in ``details``.
"""

from __future__ import annotations

from typing import Any


class ZcoreError(Exception):
    """Base class of zcore's exceptions."""

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.details = details
        for key, value in details.items():
            setattr(self, key, value)


class InvalidArgumentError(ZcoreError, ValueError):
    """A value the API does not accept (size, alignment, dtype, shape, ...)."""


class OutOfArenaError(ZcoreError, MemoryError):
    """No free range of an arena fits the request.

    Attributes: ``requested``, ``free``, ``largest_free``, ``capacity`` (bytes).
    """


class InvalidHandleError(ZcoreError, ValueError):
    """A block handle that is not live in this arena (freed twice, or foreign)."""


class HostMemoryBudgetError(ZcoreError, MemoryError):
    """A host-memory request would exceed its byte budget.

    Attributes: ``requested``, ``available``, ``budget`` (bytes).
    """


class CudaUnavailableError(ZcoreError):
    """A CUDA entry point was called where CUDA cannot be used."""


class CudaError(ZcoreError):
    """A CUDA runtime call failed."""


class NativeOSError(ZcoreError, OSError):
    """An operating-system call of the native core failed (see ``errno``)."""


class InvalidStateError(ZcoreError, RuntimeError):
    """A call the object's current state does not allow: a protocol misuse
    such as leaving a module that was never entered, or ending a step while
    a module still runs. Attributes name the object and its state."""


class DiskIOError(ZcoreError, OSError):
    """A file read or write of the I/O engine or the swap manager failed, or
    a swap directory cannot be used.

    Attributes (as reported): ``path``, ``offset``, ``bytes``, ``errno``.
    """


class DiskFullError(DiskIOError):
    """No space left for a write (ENOSPC, EDQUOT, or EFBIG: a file size
    limit), or a swap directory whose filesystem lacks room for the planned
    swap size (then ``required`` and ``available`` in bytes)."""


class ShortReadError(DiskIOError):
    """The file ended before the bytes a read asked for: it was truncated
    while the read was pending. ``offset`` is where the file ended."""


class FileTooSmallError(DiskIOError):
    """A read asks for bytes past the end of the file (``file_size``)."""


class SwapFileLostError(DiskIOError):
    """The swap file was deleted or replaced (a tmp cleaner, another job):
    what was swapped out is gone, and the swap manager refuses further work.
    ``path`` names the file; ``inode`` and ``found_inode`` (0: missing) say what changed."""


class SwapCorruptedError(DiskIOError):
    """Bytes swapped in differ from those swapped out (their XXH3 checksum):
    the swap file was written by something else, or the disk returned other
    bytes. ``id``, ``path``, ``offset`` and ``bytes`` name what was read."""


class ConfigError(ZcoreError, ValueError):
    """A config key that is unknown, unsupported, mistyped or inconsistent."""


class CheckpointError(ZcoreError, ValueError):
    """A checkpoint that cannot be saved or loaded here: missing, unsafe
    paths, a newer format, or state that cannot be stored without pickling."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint file whose bytes differ from what was written (checksum
    mismatch, truncation, unreadable metadata). ``path`` names the file."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint of another model or optimizer: ``missing``, ``unexpected``
    and ``reshaped`` list the parameter names that differ."""


_BY_STATUS: dict[str, type[ZcoreError]] = {
    "InvalidArgument": InvalidArgumentError,
    "OutOfArena": OutOfArenaError,
    "InvalidHandle": InvalidHandleError,
    "OutOfBudget": HostMemoryBudgetError,
    "CudaUnavailable": CudaUnavailableError,
    "CudaError": CudaError,
    "SystemError": NativeOSError,
    "InvalidState": InvalidStateError,
    "IoError": DiskIOError,
    "NoSpace": DiskFullError,
    "ShortRead": ShortReadError,
    "FileTooSmall": FileTooSmallError,
    "SwapFileLost": SwapFileLostError,
    "SwapCorrupted": SwapCorruptedError,
}


def exception_for(status: str) -> type[ZcoreError]:
    """The exception class for a native status code name (used by ``_C``)."""
    return _BY_STATUS.get(status, ZcoreError)
