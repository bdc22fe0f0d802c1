"""DCP's file reader, reading of each saved chunk only the bytes a load needs.

torch's FileSystemReader reads every saved chunk a read item touches whole
(``torch.load`` of the chunk's serialized tensor) to copy out the part that
overlaps: a rank that needs one row of another rank's chunk reads all of
it, and a rank of a zcore run reading FSDP2's row shards would read about
the whole checkpoint. This reader loads each chunk's record as a meta
tensor (its shape, strides and where its bytes begin: torch.serialization's
``_checkpoint_offset``, as torch's own experimental partial reader uses it),
then reads only the span of bytes the overlapping part covers. An item it
cannot read so (one stored with a transform such as compression, a torch
that records no offsets, a big-endian machine) goes to torch's reader.
"""

from __future__ import annotations

import dataclasses
import sys
from collections import defaultdict
from pathlib import Path
from typing import IO, Optional

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from zcore.errors import CheckpointCorruptError


class PartialReader(FileSystemReader):
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list[ReadItem]] = defaultdict(list)
        whole = []
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            if item.type == LoadItemType.TENSOR and not getattr(info, "transform_descriptors", None):
                by_file[info.relative_path].append(item)
            else:
                whole.append(item)
        for relative_path, items in by_file.items():
            with open(Path(self.path) / relative_path, "rb") as file:
                sources: dict = {}  # storage index -> the saved chunk as a meta tensor
                whole += [item for item in items if not self._read_part(file, item, planner, sources)]
        if whole:
            return super().read_data(dataclasses.replace(plan, items=whole), planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_part(self, file: IO[bytes], item: ReadItem, planner: LoadPlanner, sources: dict) -> bool:
        """Reads ``item``'s part of its saved chunk into its target; False
        where the chunk's record gives no byte offset."""
        info = self.storage_data[item.storage_index]
        source = sources.get(item.storage_index)
        if source is None:
            source = torch.load(self._slice_file(file, info), map_location="meta", weights_only=True)
            sources[item.storage_index] = source
        start: Optional[int] = getattr(source.untyped_storage(), "_checkpoint_offset", None)
        if start is None or sys.byteorder != "little":  # torch.save writes little-endian
            return False
        part = source
        for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths)):
            part = part.narrow(dim, offset, length)
        target = planner.resolve_tensor(item).detach()
        if part.numel():
            # From the part's first element to its last: the rows between, for a box of partial rows.
            span = 1 + sum((n - 1) * s for n, s in zip(part.shape, part.stride()))
            data = bytearray(span * part.element_size())
            file.seek(info.offset + start + part.storage_offset() * part.element_size())
            if file.readinto(data) != len(data):
                raise CheckpointCorruptError(
                    f"DCP checkpoint {self.path}: {info.relative_path} ends within the chunk of "
                    f"{item.storage_index.fqn!r} its metadata places at byte {info.offset}",
                    path=str(Path(self.path) / info.relative_path),
                )
            target.copy_(torch.frombuffer(data, dtype=part.dtype).as_strided(part.shape, part.stride()))
        planner.commit_tensor(item, target)
        return True
