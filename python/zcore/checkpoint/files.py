"""Opening a checkpoint's files as untrusted input.

Every file the checkpoint code opens itself goes through ``open_regular``:
opened with O_NONBLOCK, so that a FIFO or a device put in a file's place
cannot block the open, then refused unless ``fstat`` says it is a regular
file, so that no read can block either. Metadata is read with ``read_small``,
which refuses a file larger than its bound instead of reading it whole.
"""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path

from zcore.errors import CheckpointCorruptError, CheckpointError

# Bounds on what is read of a metadata file: far above what zcore writes
# (a tag is at most 200 characters; an index lists ~200 bytes per saved range,
# so 256 MiB is about a million ranges), far below what exhausts memory.
LATEST_BYTES = 4096
JSON_BYTES = 256 << 20

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def open_regular(path: Path, flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
    """A file descriptor of ``path``, which must be a regular file (created
    when ``flags`` has O_CREAT); raises CheckpointError naming what it is
    instead. OSError propagates for the caller to word."""
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    try:
        kind = os.fstat(fd).st_mode
        if not stat.S_ISREG(kind):
            what = next((name for test, name in _KINDS if test(kind)), "not a regular file")
            raise CheckpointError(
                f"checkpoint file {path} is {what}, not a regular file: zcore reads and writes only "
                "regular files there; remove it or load another checkpoint",
                path=str(path),
            )
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_small(path: Path, limit: int) -> bytes:
    """All of regular file ``path`` when it holds at most ``limit`` bytes;
    CheckpointCorruptError naming its size otherwise. FileNotFoundError
    propagates."""
    fd = open_regular(path)
    with os.fdopen(fd, "rb") as file:
        size = os.fstat(fd).st_size
        data = file.read(limit + 1) if size <= limit else b""
    if size > limit or len(data) > limit:  # or it grew while being read
        raise CheckpointCorruptError(
            f"checkpoint file {path} is {max(size, len(data))} bytes long, more than the {limit} "
            "bytes zcore ever writes there: it is not zcore's; remove it or load another checkpoint",
            path=str(path),
            size=max(size, len(data)),
        )
    return data


def shown(value: object, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters: values read from a
    checkpoint are quoted in error messages, whatever their size."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def size_in_bytes(text: str) -> int:
    """'5GB', '500MiB' or a plain number of bytes (transformers' and the CLI's sizes)."""
    number = text.rstrip("BbKkMmGgIi")
    unit = text[len(number):].upper()
    if unit not in _UNITS or not number.replace(".", "", 1).isdigit():
        raise ValueError(f"{text!r} is not a size such as 5GB, 500MiB or 1000000")
    return int(float(number) * _UNITS[unit])
