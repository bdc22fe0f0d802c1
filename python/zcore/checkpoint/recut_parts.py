"""Loading at another tensor-parallel layout: a tensor saved cut into
parts over T tp ranks (``NAME@tp0`` ... along one dimension) read into an
engine that cuts it over T' ranks, along another dimension, or not at all
(and a tensor saved whole read into parts).

The saved parts are joined into the whole tensor (as ``zcore consolidate``
joins them), and this engine's part is cut from it as DTensor's ``Shard``
cuts (torch.chunk). The whole tensor of the name last asked for is kept, so
that the ranges of one part, and every part a rank holds, read it once:
memory beyond the destination is one whole tensor.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from zcore.checkpoint.layout import TensorInfo
from zcore.parallel.dtensor import TensorParallelSplit


class RecutParts:
    """Which of this engine's tensors (cut as ``current`` says) the
    checkpoint (cut as ``saved_infos`` says) holds cut another way."""

    def __init__(self, saved_infos: dict[str, TensorInfo], current: dict[str, TensorInfo]) -> None:
        self.saved_infos = saved_infos
        # Each name this engine reads whose saved cut differs: (whole name, how this engine cuts it).
        self.recut: dict[str, tuple[str, Optional[TensorParallelSplit]]] = {}
        for whole, info in current.items():
            theirs = saved_infos.get(whole)
            if theirs is None or theirs.parts == info.parts or theirs.shape != info.shape:
                continue
            if info.parts is None:
                self.recut[whole] = (whole, None)
                continue
            dim, names = info.parts
            for index, name in enumerate(names):
                self.recut[name] = (whole, TensorParallelSplit(dim, index, len(names)))

    def infos(self) -> dict[str, TensorInfo]:
        """The saved infos, with this engine's names of recut tensors added
        (in the saved dtype and role)."""
        infos = dict(self.saved_infos)
        for name, (whole, _) in self.recut.items():
            infos.setdefault(name, self.saved_infos[whole])
        return infos

    def source_name(self, name: str) -> str:
        """The saved tensor whose per-tensor records (scalar optimizer
        states) stand for ``name``'s."""
        if name not in self.recut:
            return name
        whole = self.recut[name][0]
        parts = self.saved_infos[whole].parts
        return whole if parts is None else parts[1][0]

    def reading(self, saved: Any) -> RecutReader:
        """A range source (zcore.checkpoint.load.RangeSource) over ``saved``
        that reads this engine's names."""
        return RecutReader(saved, self)


class RecutReader:
    def __init__(self, saved: Any, parts: RecutParts) -> None:
        self._saved = saved
        self._parts = parts
        self._infos = parts.saved_infos
        self._recut = parts.recut
        self._cached: Optional[tuple[str, Optional[str], torch.Tensor]] = None

    def read(self, name: str, start: int, stop: int, state: Optional[str] = None) -> torch.Tensor:
        if name not in self._recut:
            return self._saved.read(name, start, stop, state)
        whole, split = self._recut[name]
        values = self._whole(whole, state)
        if split is not None:
            sizes = [shape[split.dim] for shape in split.part_shapes(tuple(values.shape))]
            values = values.narrow(split.dim, sum(sizes[: split.index]), sizes[split.index])
        return values.reshape(-1)[start:stop].clone()

    def dtype(self, name: str, start: int, stop: int, state: Optional[str] = None) -> torch.dtype:
        if name not in self._recut:
            return self._saved.dtype(name, start, stop, state)
        return self._whole(self._recut[name][0], state).dtype

    def state_keys(self, name: str) -> list[str]:
        return self._saved.state_keys(self._parts.source_name(name))

    def read_whole(self, rank: int, kind: str, key: str) -> torch.Tensor:
        return self._saved.read_whole(rank, kind, key)

    def _whole(self, whole: str, state: Optional[str]) -> torch.Tensor:
        if self._cached is not None and self._cached[:2] == (whole, state):
            return self._cached[2]
        self._cached = None  # free the previous one before reading the next
        info = self._infos[whole]
        if info.parts is None:
            values = self._saved.read(whole, 0, info.numel, state).view(info.shape)
        else:
            dim, names = info.parts
            pieces = [self._saved.read(n, 0, self._infos[n].numel, state).view(self._infos[n].shape)
                      for n in names if self._infos[n].numel > 0]
            values = torch.cat(pieces, dim=dim)
        self._cached = (whole, state, values)
        return values
