"""Reads any element range of any saved tensor, whichever ranks wrote it.

Every rank's index lists the ranges its files hold, per tensor (and per
optimizer state key). To fill a range of the current layout, the reader
walks the saved ranges that overlap it, reading each saved tensor whole
(verifying its checksum) straight into the destination when it lies inside
it, else into scratch memory from which the overlap is copied. Memory beyond
the destination is at most one saved range.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterator
from typing import Optional

import torch
from tqdm import tqdm

from zcore.memory.aio import AioEngine
from zcore.checkpoint import directory
from zcore.checkpoint.schema import RankIndex
from zcore.checkpoint.tensor_file import FileRecord, TensorFileReader
from zcore.errors import CheckpointCorruptError


@dataclass(frozen=True)
class _Saved:
    start: int
    stop: int
    file: tuple[int, str]  # (rank, "weights" | "state")
    key: str  # the tensor's name in that file


class SavedRanges:
    def __init__(
        self,
        tag_dir: Path,
        indexes: list[RankIndex],
        engine: Optional[AioEngine] = None,
        progress: Optional[tqdm] = None,
    ) -> None:
        """``indexes``: validated (zcore.checkpoint.load.read_indexes); ``engine``:
        read with O_DIRECT through it; ``progress``: advanced by the bytes
        each ``read`` returns."""
        self.tag_dir = tag_dir
        self._engine = engine
        self._progress = progress
        last = directory.rank_index(len(indexes) - 1)
        self._indexes = directory.rank_index(0) + (f" to {last}" if len(indexes) > 1 else "")
        self._records: dict[tuple[int, str], FileRecord] = {}
        self._saved: dict[tuple[str, Optional[str]], list[_Saved]] = defaultdict(list)
        for rank, index in enumerate(indexes):
            for kind in ("weights", "state"):
                r = getattr(index.files, kind)
                self._records[(rank, kind)] = FileRecord(r.name, r.bytes, r.header, dict(r.tensors))
            for key, r in index.ranges.items():
                self._saved[(r.of, r.state)].append(_Saved(r.start, r.stop, (rank, r.file), key))
        for ranges in self._saved.values():
            ranges.sort(key=lambda s: s.start)
        self._starts = {k: [s.start for s in v] for k, v in self._saved.items()}
        self._readers: dict[tuple[int, str], TensorFileReader] = {}

    def has(self, name: str, state: Optional[str] = None) -> bool:
        return (name, state) in self._saved

    def state_keys(self, name: str) -> list[str]:
        return [s for (n, s) in self._saved if n == name and s is not None]

    def dtype(self, name: str, start: int, stop: int, state: Optional[str] = None) -> torch.dtype:
        """What ``read`` would return for the range, from the files' headers
        only: its dtype, once every element is known to be listed."""
        dtype = None
        for saved, _, _ in self._covering(name, start, stop, state):
            dtype = self._reader(saved.file).entries[saved.key].dtype
        assert dtype is not None  # _covering raises on an empty range
        return dtype

    def read(self, name: str, start: int, stop: int, state: Optional[str] = None) -> torch.Tensor:
        """Elements [start, stop) of saved tensor ``name`` (or of its optimizer state ``state``)."""
        out: Optional[torch.Tensor] = None
        for saved, position, hi in self._covering(name, start, stop, state):
            reader = self._reader(saved.file)
            if out is None:
                out = reader.empty(saved.key, stop - start)
            target = out[position - start : hi - start]
            if saved.start == position and saved.stop == hi:
                reader.read(saved.key, out=target)
            else:
                whole = reader.read(saved.key).view(-1)
                if whole.numel() != saved.stop - saved.start:
                    raise CheckpointCorruptError(
                        f"checkpoint {self.tag_dir}: tensor {saved.key!r} of rank {saved.file[0]}'s {saved.file[1]} "
                        f"file holds {whole.numel()} elements, its index says [{saved.start}, {saved.stop})",
                        path=str(self.tag_dir),
                    )
                target.copy_(whole[position - saved.start : hi - saved.start])
        assert out is not None  # _covering raises on an empty range
        if self._progress is not None:
            self._progress.update(out.nbytes)
        return out

    def _covering(
        self, name: str, start: int, stop: int, state: Optional[str]
    ) -> Iterator[tuple[_Saved, int, int]]:
        """The saved ranges that make up [start, stop), each with the part
        of it they give: (saved range, first element, end); raises once the
        next element is listed by none."""
        ranges = self._saved.get((name, state), [])
        first = max(0, bisect.bisect_right(self._starts.get((name, state), []), start) - 1)
        position = start
        for saved in ranges[first:]:
            if position >= stop or saved.start > position:
                break
            if saved.stop <= position:
                continue
            hi = min(stop, saved.stop)
            yield saved, position, hi
            position = hi
        if position < stop or position == start:
            what = name if state is None else f"optimizer state {state!r} of {name}"
            raise CheckpointCorruptError(
                f"checkpoint {self.tag_dir} lacks elements [{position}, {stop}) of {what}: no rank index "
                f"({self._indexes}) lists them; the checkpoint is incomplete, load another tag",
                path=str(self.tag_dir),
            )

    def read_whole(self, rank: int, kind: str, key: str) -> torch.Tensor:
        """Tensor ``key`` of rank ``rank``'s ``kind`` file (RNG, client tensors)."""
        return self._reader((rank, kind)).read(key)

    def _reader(self, file: tuple[int, str]) -> TensorFileReader:
        reader = self._readers.get(file)
        if reader is None:
            record = self._records[file]
            reader = TensorFileReader(self.tag_dir / record.name, record, self._engine)
            self._readers[file] = reader
        return reader

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()

    def __enter__(self) -> SavedRanges:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()
