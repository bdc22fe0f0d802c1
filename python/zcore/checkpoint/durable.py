"""Writes that survive a crash: a file is complete under its final name or
absent.

Every file is written under a temporary name in the same directory,
fsynced, renamed, and the directory fsynced, so a process killed at any
moment leaves either the old state or the new one. JSON files carry a
checksum of their own content.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
from pathlib import Path
from typing import Optional

import xxhash

from zcore.memory.aio import AioEngine
from zcore.checkpoint.direct_file import DirectAppender
from zcore.checkpoint.files import JSON_BYTES, open_regular, read_small
from zcore.errors import CheckpointCorruptError, DiskFullError, DiskIOError

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def io_error(exc: OSError, path: Path, doing: str, needs: Optional[int] = None) -> DiskIOError:
    """The error for ``exc``, raised ``doing`` (words such as "writing")
    ``path``: every file and directory a checkpoint writes maps its errors
    here. A full disk (or quota, or file size limit) is a DiskFullError
    naming the path, the bytes the request ``needs`` where known and those
    free on its filesystem; another failure a DiskIOError."""
    if exc.errno not in _NO_SPACE:
        return DiskIOError(f"{doing} {path} failed: {exc.strerror}", path=str(path), errno=exc.errno)
    free = _free_bytes(path)
    figures = [f"it needs {needs} bytes" if needs is not None else None,
               f"its filesystem has {free} bytes free" if free is not None else None]
    said = ", ".join(f for f in figures if f)
    return DiskFullError(
        f"no space left on the device {doing} {path} ({exc.strerror}{'; ' + said if said else ''}): free "
        "space or save elsewhere; checkpoints already written are untouched",
        path=str(path),
        errno=exc.errno,
        required=needs,
        available=free,
    )


def _free_bytes(path: Path) -> Optional[int]:
    """Bytes an unprivileged writer may still use on ``path``'s filesystem
    (of its nearest existing directory); None where it cannot be asked."""
    for where in (path, *path.parents):
        try:
            fs = os.statvfs(where)
        except OSError:
            continue
        return fs.f_bavail * fs.f_frsize
    return None


def _block_bytes(path: Path) -> Optional[int]:
    """The bytes one new directory or file entry takes at least: a block of
    the filesystem ``path`` will be on."""
    for where in path.parents:
        try:
            return os.statvfs(where).f_frsize
        except OSError:
            continue
    return None


def make_dir(path: Path, parents: bool = False, exist_ok: bool = False) -> None:
    """``path`` created, as Path.mkdir with these options; its failure
    mapped by ``io_error`` (a directory takes a block of the filesystem)."""
    try:
        path.mkdir(parents=parents, exist_ok=exist_ok)
    except OSError as exc:
        raise io_error(exc, path, "creating the directory", _block_bytes(path)) from None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class TempFile:
    """A file being written as ``.NAME.tmp`` beside ``path``; with an
    ``engine``, its bytes go out with O_DIRECT writes (zcore.checkpoint.direct_file)."""

    def __init__(self, path: Path, engine: Optional[AioEngine] = None, size: int = 0) -> None:
        """``size``: the final size, when known. It is reserved up front, so
        a full disk fails before any byte is written, and O_DIRECT writes
        fill allocated blocks instead of extending the file one request at
        a time."""
        self.path = Path(path)
        self.temp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            self.fd = open_regular(self.temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        except OSError as exc:
            raise io_error(exc, self.path, "creating", _block_bytes(self.path)) from None
        self._direct = DirectAppender(engine, self.temp) if engine is not None else None
        if size:
            try:
                os.posix_fallocate(self.fd, 0, size)
            except OSError as exc:
                self.abort()
                raise io_error(exc, self.path, "reserving space for", size) from None

    def write(self, data: memoryview) -> None:
        if self._direct is not None:
            self._direct_io(self._direct.append, data)
            return
        done = 0
        try:
            while done < len(data):
                done += os.write(self.fd, data[done:])
        except OSError as exc:
            self.abort()
            raise io_error(exc, self.path, "writing", len(data) - done) from None

    def commit(self) -> None:
        if self._direct is not None:
            self._direct_io(self._direct.finish)
        try:
            os.fsync(self.fd)
            os.close(self.fd)
            self.fd = -1
            os.rename(self.temp, self.path)
            fsync_dir(self.path.parent)
        except OSError as exc:
            self.abort()
            raise io_error(exc, self.path, "committing") from None

    def _direct_io(self, call, *args) -> None:
        try:
            call(*args)
        except DiskIOError as exc:  # the engine's, naming the temporary file
            self.abort()
            code = getattr(exc, "errno", errno.EIO)
            raise io_error(OSError(code, os.strerror(code)), self.path, "writing", getattr(exc, "required", None) or getattr(exc, "bytes", None)) from None
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        if self._direct is not None:
            with contextlib.suppress(Exception):  # already failing: the first error is the one to report
                self._direct.wait_all()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.temp.unlink(missing_ok=True)


def write_bytes(path: Path, data: bytes) -> None:
    file = TempFile(path)
    file.write(memoryview(data))
    file.commit()


def _canonical(content: object) -> bytes:
    return json.dumps(content, sort_keys=True, separators=(",", ":")).encode()


def write_json(path: Path, content: dict) -> str:
    """Writes ``content`` with its checksum; returns the checksum."""
    checksum = xxhash.xxh3_64_hexdigest(_canonical(content))
    write_bytes(path, json.dumps({"xxh3_64": checksum, "content": content}, indent=1).encode())
    return checksum


def read_json(path: Path, expected: str | None = None) -> dict:
    """The content of a file written by ``write_json``, verified (and equal
    to ``expected`` when given: the checksum an index recorded)."""
    try:
        raw = read_small(Path(path), JSON_BYTES)
    except FileNotFoundError:
        raise CheckpointCorruptError(
            f"checkpoint file {path} is missing: the checkpoint is incomplete; load another tag",
            path=str(path),
        ) from None
    except OSError as exc:
        raise CheckpointCorruptError(f"cannot read checkpoint file {path}: {exc.strerror}", path=str(path)) from None
    try:
        wrapper = json.loads(raw)
        checksum, content = wrapper["xxh3_64"], wrapper["content"]
        actual = xxhash.xxh3_64_hexdigest(_canonical(content))
    except (ValueError, KeyError, TypeError, RecursionError):  # not JSON, not an object, nested too deep
        checksum, content, actual = None, None, None
    if content is None or actual != checksum or (expected is not None and checksum != expected):
        raise CheckpointCorruptError(
            f"checkpoint file {path} fails its checksum: it changed after it was written (disk "
            "error, partial copy or edit); restore it from a copy or load an earlier tag",
            path=str(path),
        )
    return content


_RENAME_EXCHANGE = 2
_libc = ctypes.CDLL(None, use_errno=True)
_AT_FDCWD = -100


def replace_dir(new: Path, final: Path) -> None:
    """Makes directory ``new`` appear as ``final`` in one atomic step: a
    crash leaves either the old ``final`` or the new one. The old one is
    then deleted."""
    if not final.exists():
        try:
            os.rename(new, final)
        except OSError as exc:
            raise io_error(exc, final, "renaming the finished checkpoint to", _block_bytes(final)) from None
        fsync_dir(final.parent)
        return
    # Swap both names at once (Linux renameat2); a plain rename cannot
    # replace a non-empty directory.
    rc = _libc.renameat2(_AT_FDCWD, os.fsencode(new), _AT_FDCWD, os.fsencode(final), _RENAME_EXCHANGE)
    if rc != 0:
        err = ctypes.get_errno()
        if err in _NO_SPACE:
            raise io_error(OSError(err, os.strerror(err)), final, "replacing the checkpoint", _block_bytes(final))
        raise DiskIOError(
            f"cannot replace checkpoint {final} atomically ({os.strerror(err)}): this filesystem "
            "lacks renameat2(RENAME_EXCHANGE); save under a new tag instead",
            path=str(final),
            errno=err,
        )
    fsync_dir(final.parent)
    remove_tree(new)  # now the old checkpoint


def remove_tree(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)
