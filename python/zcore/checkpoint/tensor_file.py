"""safetensors files written and read as streams, with a checksum per tensor.

The safetensors library builds a whole file in memory before writing it and
reads through mmap, where every page touched counts toward the process's
RSS. Checkpoints and consolidation must stream tensor by tensor, so zcore
writes the (simple) format itself: the header first, since every name, dtype
and shape is known up front, then each tensor's bytes straight from its
memory, hashed on the way (with O_DIRECT when given an AioEngine). The
files remain ordinary safetensors files.

A file's checksums (one for the header, one per tensor: xxh3-64) are
returned as a ``FileRecord``; whoever indexes the file keeps them, and the
reader verifies every byte it returns against them.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import xxhash

from zcore.memory.aio import AioEngine
from zcore.checkpoint import durable
from zcore.memory.staging import page_placed
from zcore.checkpoint.files import open_regular
from zcore.errors import CheckpointCorruptError, CheckpointError

_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}
_ALIGN = 8  # header padding, as the safetensors library writes it
_MAX_HEADER = 100_000_000  # bytes; the safetensors library refuses longer headers too


def storable(dtype: torch.dtype, what: str) -> torch.dtype:
    """``dtype`` if the files zcore writes (checkpoints, weights) can hold
    it; else a CheckpointError naming ``what`` and the dtypes they hold."""
    if dtype not in _CODES:
        raise CheckpointError(
            f"{what} is a tensor of dtype {dtype}, which zcore's checkpoint and weight files (safetensors) "
            f"cannot hold; they hold {', '.join(map(str, _CODES))}: convert it (a complex tensor with "
            "torch.view_as_real) or leave it out",
            dtype=str(dtype),
        )
    return dtype


def dtype_code(dtype: torch.dtype, what: str) -> str:
    """The safetensors name of ``dtype`` (``storable``'s check first)."""
    return _CODES[storable(dtype, what)]


def dtype_of(code: str) -> torch.dtype:
    return _DTYPES[code]


def digest(data: memoryview) -> str:
    return xxhash.xxh3_64_hexdigest(data)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


@dataclass(frozen=True)
class FileRecord:
    """What an index keeps about a written file to verify it later."""

    name: str
    nbytes: int
    header: str  # checksum of the header bytes
    tensors: dict[str, str]  # tensor name -> checksum of its bytes

    def to_json(self) -> dict:
        return {"name": self.name, "bytes": self.nbytes, "header": self.header, "tensors": self.tensors}


def bytes_of(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def plan_files(specs: list[TensorSpec], max_bytes: int) -> list[list[TensorSpec]]:
    """``specs`` in order, split into files of at most ``max_bytes`` of data
    (a larger tensor gets a file of its own)."""
    files: list[list[TensorSpec]] = []
    size = 0
    for spec in specs:
        if not files or (files[-1] and size + spec.nbytes > max_bytes):
            files.append([])
            size = 0
        files[-1].append(spec)
        size += spec.nbytes
    return files


class TensorFileWriter:
    """Writes ``specs``' tensors, in that order, to ``path`` through a
    temporary name: ``write`` each tensor, then ``commit`` (fsync, rename)."""

    def __init__(
        self,
        path: Path,
        specs: list[TensorSpec],
        metadata: Optional[dict[str, str]] = None,
        engine: Optional[AioEngine] = None,
    ) -> None:
        """``engine``: write with O_DIRECT through it (zcore.checkpoint.direct_file)."""
        self.path = Path(path)
        self.specs = specs
        header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
        offset = 0
        for spec in specs:
            header[spec.name] = {
                "dtype": dtype_code(spec.dtype, f"tensor {spec.name!r} of {self.path.name}"),
                "shape": list(spec.shape),
                "data_offsets": [offset, offset + spec.nbytes],
            }
            offset += spec.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-(len(raw) + 8) % _ALIGN)
        head = struct.pack("<Q", len(raw)) + raw
        self._nbytes = len(head) + offset
        self._file = durable.TempFile(self.path, engine, self._nbytes)
        self._file.write(memoryview(head))
        self._header_digest = digest(memoryview(head))
        self._digests: dict[str, str] = {}

    def write(self, tensor: torch.Tensor) -> None:
        spec = self.specs[len(self._digests)]
        if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise ValueError(
                f"{self.path.name}: tensor {spec.name!r} should be {spec.dtype} of shape {spec.shape}, "
                f"got {tensor.dtype} of shape {tuple(tensor.shape)}"
            )
        data = bytes_of(tensor.detach().contiguous().cpu())
        self._digests[spec.name] = digest(data)
        self._file.write(data)

    def commit(self) -> FileRecord:
        if len(self._digests) != len(self.specs):
            missing = [s.name for s in self.specs[len(self._digests) :]]
            raise RuntimeError(f"{self.path.name}: tensors {missing[:3]} were never written")
        self._file.commit()
        return FileRecord(self.path.name, self._nbytes, self._header_digest, self._digests)

    def abort(self) -> None:
        self._file.abort()

    def __enter__(self) -> TensorFileWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


@dataclass(frozen=True)
class _Entry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offset in the file
    nbytes: int


def _entry(value: dict, data_start: int, size: int) -> _Entry:
    """One header entry, checked to describe bytes inside the file."""
    dtype = dtype_of(value["dtype"])
    shape = tuple(value["shape"])
    begin, end = value["data_offsets"]
    if not all(type(v) is int and v >= 0 for v in (*shape, begin, end)):
        raise ValueError(f"shape {shape} and offsets {[begin, end]} must be non-negative integers")
    if not begin <= end <= size - data_start or math.prod(shape) * dtype.itemsize != end - begin:
        raise ValueError(f"offsets {[begin, end]} do not hold a {dtype} tensor of shape {list(shape)} in the file")
    return _Entry(dtype, shape, data_start + begin, end - begin)


class TensorFileReader:
    """Reads tensors of one file, each verified against ``record`` (when
    given: checkpoints always give it; a file from elsewhere may not)."""

    def __init__(self, path: Path, record: Optional[FileRecord] = None, engine: Optional[AioEngine] = None) -> None:
        """``engine``: read with O_DIRECT through it (1.4-1.5 GB/s per process
        against 0.5-0.7 GB/s through the page cache, measured with two
        processes reading 3 GB each, cold)."""
        self.path = Path(path)
        self.record = record
        self._engine = engine
        try:
            self._file = open(open_regular(self.path), "rb", buffering=0)
        except FileNotFoundError:
            raise self._corrupt("is missing") from None
        except OSError as exc:
            raise self._corrupt(f"cannot be opened ({exc.strerror})") from None
        try:
            self.entries = self._read_header()
        except BaseException:
            self._file.close()
            raise

    def _read_header(self) -> dict[str, _Entry]:
        size = os.fstat(self._file.fileno()).st_size
        if self.record is not None and size != self.record.nbytes:
            raise self._corrupt(f"is {size} bytes long, {self.record.nbytes} were written")
        head = self._file.read(8)
        if len(head) != 8:
            raise self._corrupt("ends inside its header")
        (length,) = struct.unpack("<Q", head)
        if length > min(size - 8, _MAX_HEADER):
            raise self._corrupt(f"declares a header of {length} bytes, longer than the file or {_MAX_HEADER} bytes")
        raw = self._file.read(length)
        if self.record is not None and digest(memoryview(head + raw)) != self.record.header:
            raise self._corrupt("fails the checksum of its header")
        try:
            header = json.loads(raw)
            entries = {}
            for name, value in header.items():
                if name == "__metadata__":
                    continue
                code = value.get("dtype") if isinstance(value, dict) else None
                if isinstance(code, str) and code not in _DTYPES:
                    raise CheckpointError(
                        f"{self.path} holds tensor {name!r} as {code}, a dtype zcore cannot read "
                        f"(it reads {', '.join(sorted(_DTYPES))}); convert the file's tensors first"
                    )
                entries[name] = _entry(value, 8 + length, size)
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise self._corrupt(f"has an unreadable header ({str(exc)[:200]})") from None
        return entries

    def read(self, name: str, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Tensor ``name``, into ``out`` (a contiguous CPU tensor with as
        many bytes) when given; verified before it is returned."""
        entry = self.entries.get(name)
        if entry is None:
            raise self._corrupt(f"lacks tensor {name!r} that its index lists")
        if out is None:
            out = self.empty(name)
        if not out.is_contiguous() or out.device.type != "cpu":
            raise ValueError(f"{self.path.name}: cannot read {name!r} into a non-contiguous or {out.device} tensor")
        if out.dtype != entry.dtype:
            raise self._corrupt(f"holds tensor {name!r} as {entry.dtype}, where the checkpoint expects {out.dtype}")
        view = bytes_of(out)
        if len(view) != entry.nbytes:
            raise self._corrupt(f"holds {entry.nbytes} bytes for tensor {name!r}, its index says {len(view)}")
        if self._engine is not None and entry.nbytes:
            self._engine.pread(out, self.path, entry.start).wait()
        else:
            self._read_into(view, entry.start, name)
        if self.record is not None:
            expected = self.record.tensors.get(name)
            if expected is None or digest(view) != expected:
                raise self._corrupt(f"fails the checksum of tensor {name!r}")
        return out

    def read_range(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of tensor ``name`` flattened, alone. Only
        for a file without a record: checksums cover whole tensors."""
        if self.record is not None:
            raise ValueError(f"{self.path.name}: a checksummed file's tensors are read whole")
        entry = self.entries.get(name)
        if entry is None:
            raise self._corrupt(f"lacks tensor {name!r} that its index lists")
        numel = entry.nbytes // entry.dtype.itemsize
        if not 0 <= start <= stop <= numel:
            raise ValueError(f"{self.path.name}: tensor {name!r} has {numel} elements, not [{start}, {stop})")
        out = torch.empty(stop - start, dtype=entry.dtype)
        self._read_into(bytes_of(out), entry.start + start * entry.dtype.itemsize, name)
        return out

    def _read_into(self, view: memoryview, offset: int, name: str) -> None:
        self._file.seek(offset)
        done = 0
        while done < len(view):
            n = self._file.readinto(view[done:])
            if not n:
                raise self._corrupt(f"ends inside tensor {name!r}")
            done += n

    def empty(self, name: str, numel: Optional[int] = None) -> torch.Tensor:
        """A tensor to read tensor ``name`` into (its first ``numel`` elements
        when given: the start of a larger one), placed so that its address
        and the tensor's file offset are equal modulo the page size: O_DIRECT
        then reads straight into it instead of through bounce buffers."""
        entry = self.entries[name]
        shape = entry.shape if numel is None else (numel,)
        if entry.start % entry.dtype.itemsize:  # no address of the dtype's alignment fits
            return torch.empty(shape, dtype=entry.dtype)
        size = math.prod(shape) * entry.dtype.itemsize
        return page_placed(size, entry.start).view(entry.dtype).view(shape)

    def _corrupt(self, what: str) -> CheckpointCorruptError:
        if self.record is None:  # a file from elsewhere (a Hugging Face model), never indexed by zcore
            return CheckpointCorruptError(
                f"safetensors file {self.path} {what}: it is damaged or incomplete (a partial download "
                "or copy?); fetch it again", path=str(self.path),
            )
        return CheckpointCorruptError(
            f"checkpoint file {self.path} {what}: it changed after it was written (disk error, partial "
            "copy or edit); restore it from a copy or load an earlier tag",
            path=str(self.path),
        )

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> TensorFileReader:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()
