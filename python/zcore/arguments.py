"""The kinds of argument zcore's API takes, each checked in one place: a
torch dtype, a byte alignment, a tensor shape, a directory. Every function that takes
one checks it here, so that a wrong value is refused alike wherever it is
passed: a :class:`zcore.InvalidArgumentError` naming the argument, the
value given and what the argument takes.
"""

from __future__ import annotations

import math
import os
from collections.abc import Collection
from pathlib import Path
from typing import Any, Optional

import torch

from zcore.errors import InvalidArgumentError

INT64_MAX = 2**63 - 1  # the native core counts bytes and elements in int64

# Floating-point dtypes that a checkpoint or a weights file can hold
# (zcore.checkpoint.tensor_file), for the functions that write weights in a dtype.
FLOATING_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def dtype(value: Any, name: str, allowed: Optional[Collection[torch.dtype]] = None) -> torch.dtype:
    """``value`` if it is a ``torch.dtype`` (one of ``allowed``, when
    given); else raises naming ``name``. A string, a Python type (``float``)
    or None is refused, with the torch dtype it may have meant."""
    if not isinstance(value, torch.dtype):
        meant = _dtype_named(value)
        hint = f"; did you mean torch.{meant}?" if meant else ""
        raise InvalidArgumentError(
            f"{name} must be a torch.dtype, such as torch.float32, got {value!r} "
            f"(a {type(value).__name__}){hint}",
            argument=name,
        )
    if allowed is not None and value not in allowed:
        raise InvalidArgumentError(
            f"{name}={value} is not one this takes; it takes {', '.join(map(str, allowed))}",
            argument=name,
        )
    return value


def _dtype_named(value: Any) -> Optional[str]:
    """The torch dtype a string or Python type names ("float32",
    "torch.bfloat16", float), or None."""
    if isinstance(value, str):
        candidate = value.removeprefix("torch.")
        return candidate if isinstance(getattr(torch, candidate, None), torch.dtype) else None
    return {float: "float32", int: "int64", bool: "bool", complex: "complex64"}.get(value)


def alignment(value: Any, name: str = "alignment") -> int:
    """``value`` if it is a positive power of two (bytes); else raises
    naming ``name``. Where a place needs a coarser alignment (an element's
    size, a pointer's), it rounds a valid one up itself."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value & (value - 1):
        raise InvalidArgumentError(
            f"{name} must be a positive power of two (1, 2, 4, ... bytes), got {value!r}",
            argument=name,
        )
    return value


def shape(value: Any, element: torch.dtype, what: str) -> tuple[torch.Size, int]:
    """(``value`` as a torch.Size, its bytes in ``element`` dtype) for a
    tensor that ``what`` names; raises unless every dimension is a positive
    integer and the bytes fit in int64 (torch.Size.numel() wraps around
    past that, to zero or below)."""
    try:
        size = torch.Size(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidArgumentError(
            f"{what}: shape must be a tuple of non-negative ints below 2**63, got {value!r} ({exc})",
            shape=value,
        ) from None
    dims = tuple(size)
    if any(d <= 0 for d in dims):
        raise InvalidArgumentError(
            f"{what} of shape={dims} has no elements; every dimension must be positive",
            shape=dims,
        )
    elements = math.prod(dims)
    nbytes = elements * element.itemsize
    if nbytes > INT64_MAX:
        raise InvalidArgumentError(
            f"{what} of shape={dims} is too large: {elements} elements of {element.itemsize} bytes are "
            f"{nbytes} bytes, beyond the 2**63 - 1 bytes zcore can count",
            shape=dims,
            bytes=nbytes,
        )
    return size, nbytes


def directory(value: Any, name: str) -> Path:
    """A directory's path, given as a str or os.PathLike; the empty string
    (which would mean the working directory) is refused, as DeepSpeed refuses it."""
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise InvalidArgumentError(
            f"{name} must name a directory (a str or pathlib.Path), got {value!r}", argument=name
        )
    return Path(value)
