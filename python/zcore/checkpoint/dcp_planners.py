"""torch.distributed.checkpoint's default planners, taught zcore's ranges.

DCP plans a save or a load from a state dict of tensors it knows (plain
tensors, DTensors, ShardedTensors). A zcore rank holds flat ranges of its
tensors (zcore.checkpoint.layout), which are none of those; the planners
take them beside the state dict, as ``RangedTensor``s keyed by their path
in the nested state dict, and cut each range into the n-d boxes DCP's
metadata describes chunks by (zcore.checkpoint.flat_chunks). A save writes
exactly this rank's boxes; a load asks DCP's resharding
(``create_read_items_for_chunk_list``) for the parts of the saved chunks,
whoever saved them (FSDP2's row shards, or zcore's boxes at any world
size), that overlap this rank's boxes, and reads them into its views.
Everything else in the state dict (Adam's step, the param groups) goes
through the default planners as it is.
"""

from __future__ import annotations

import dataclasses
import io
import math
from dataclasses import dataclass, field
from typing import Union

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from zcore.checkpoint.flat_chunks import flat_boxes
from zcore.errors import CheckpointCorruptError

KeyPath = tuple[Union[str, int], ...]  # a value's place in the nested state dict


def flat_key(path: KeyPath) -> str:
    """The key DCP stores a value under: its path joined by dots (DCP's flatten_state_dict)."""
    return ".".join(map(str, path))


@dataclass
class RangedTensor:
    """This rank's ranges of one tensor's flattened elements: to save, views
    of its values; to load, the buffers to fill."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    ranges: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (first element, 1-D values)

    def boxes(self) -> dict[tuple[int, ...], torch.Tensor]:
        """Each box's offsets and its n-d view of the ranges."""
        views = {}
        for start, values in self.ranges:
            for box in flat_boxes(self.shape, start, start + values.numel()):
                at = box.first - start
                views[box.offsets] = values[at : at + box.numel].view(box.sizes)
        return views


def _chunk(offsets: tuple[int, ...], view: torch.Tensor) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=view.shape)


class RangedSavePlanner(DefaultSavePlanner):
    def __init__(self, ranged: dict[KeyPath, RangedTensor]) -> None:
        super().__init__()
        self._ranged = {flat_key(path): (path, tensor) for path, tensor in ranged.items()}
        self._views = {key: tensor.boxes() for key, (_, tensor) in self._ranged.items()}

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = [
            WriteItem(
                index=MetadataIndex(key, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=_chunk(offsets, view),
                    properties=TensorProperties(dtype=tensor.dtype),
                    size=torch.Size(tensor.shape),
                ),
            )
            for key, (_, tensor) in self._ranged.items()
            for offsets, view in self._views[key].items()
        ]
        # The paths of the ranged values, as DCP records every value's (to rebuild the nesting).
        mappings = {**(plan.planner_data or {}), **{key: path for key, (path, _) in self._ranged.items()}}
        self.plan = dataclasses.replace(plan, items=plan.items + items, planner_data=mappings)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> object:
        views = self._views.get(index.fqn)
        return super().lookup_object(index) if views is None else views[tuple(index.offset)]


class RangedLoadPlanner(DefaultLoadPlanner):
    def __init__(self, ranged: dict[KeyPath, RangedTensor], checkpoint: str) -> None:
        """``checkpoint``: its directory, for errors."""
        super().__init__()
        self._views = {flat_key(path): tensor.boxes() for path, tensor in ranged.items()}
        self._checkpoint = checkpoint
        self.loaded_bytes: dict[str, object] = {}  # by flat key: the state dict's non-tensor values, read

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        items: list[ReadItem] = []
        for key, views in self._views.items():
            saved = self.metadata.state_dict_metadata[key]
            assert isinstance(saved, TensorStorageMetadata)  # checked against the model before
            reads = create_read_items_for_chunk_list(key, saved, [_chunk(o, v) for o, v in views.items()])
            # DCP leaves what no saved chunk covers as it was: an incomplete checkpoint.
            found, wanted = sum(math.prod(r.lengths) for r in reads), sum(v.numel() for v in views.values())
            if found != wanted:
                raise CheckpointCorruptError(
                    f"DCP checkpoint {self._checkpoint}: its chunks of {key!r} hold {found} of the {wanted} "
                    "elements this rank needs; the checkpoint is incomplete (a rank's save did not finish?)",
                    path=self._checkpoint,
                )
            items += reads
        return dataclasses.replace(plan, items=plan.items + items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        views = self._views.get(index.fqn)
        return super().lookup_tensor(index) if views is None else views[tuple(index.offset)]

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # Hyper-parameters and names: torch's safe loader, never arbitrary unpickling.
        self.loaded_bytes[read_item.dest_index.fqn] = torch.load(value, weights_only=True)
