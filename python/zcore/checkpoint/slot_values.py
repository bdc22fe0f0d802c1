"""A checkpoint's view of where each slot's values are, read or staged
where they live.

Slots in memory (zcore.checkpoint.layout) are views, read and written in
place. Two kinds are on NVMe and have only a meta tensor:
- trained slots whose optimizer states are on NVMe (zcore.step.swapped_optimizer):
  saving streams the sub-groups (``trained``); loading writes new sub-groups
  aside (``SwappedMaster.stage``) and adopts them at commit;
- frozen ZeRO-3 slots whose group's shard is on NVMe: read one group at a
  time (``frozen``); a load stages new shards aside, adopted at commit.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Optional

import torch

from zcore.checkpoint.layout import Slot
from zcore.errors import InvalidStateError
from zcore.step.swapped_optimizer import SwappedMaster, resting_keys, state_rows


class SlotValues:
    def __init__(self, engine: Any) -> None:
        optimizer = engine.optimizer  # None: an inference engine, without trained slots
        self._master = optimizer.master if optimizer is not None else None
        self._inner = optimizer.inner if optimizer is not None else None
        self._residency = engine.residency
        self._rows = state_rows(self._inner) if self._inner is not None else None
        self._group: Optional[int] = None  # the frozen group whose shard is cached
        self._shard: Optional[torch.Tensor] = None

    @property
    def swapped(self) -> bool:
        """Whether the trained values and their optimizer states are on NVMe."""
        return isinstance(self._master, SwappedMaster)

    def state_template(self, slot: Slot) -> Optional[dict]:
        """A trained slot's optimizer state as the optimizer keeps it, for
        the names, dtypes and sizes of what will be saved (tensors of states
        on NVMe are meta); None before its first step."""
        state = self._inner.state.get(slot.piece)
        if not state:
            return None
        if self.swapped:
            return _swapped_state(state, self.rows(slot.piece), lambda row: slot.data)
        return state

    def rows(self, piece: torch.Tensor) -> dict[str, int]:
        """Where a trained piece's ranged states rest in its sub-groups (states on NVMe)."""
        return self._rows(piece)

    def moment_like(self, slot: Slot) -> torch.Tensor:
        """An empty tensor of the dtype a trained slot's moments are kept
        in: zcore's CPUAdam says (bf16 master weights may keep fp32
        moments); a torch optimizer keeps its parameter's."""
        state_dtype_of = getattr(self._inner, "state_dtype_of", None)
        dtype = state_dtype_of(slot.piece) if state_dtype_of is not None else slot.data.dtype
        return torch.empty(0, dtype=dtype)

    def trained(self, slots: list[Slot]) -> Iterator[tuple[Slot, torch.Tensor, Optional[dict]]]:
        """``(slot, values, state)`` for every trained slot, in ``slots``'
        order (the layout's), each valid until the next one."""
        if not self.swapped:
            for slot in slots:
                yield slot, slot.data, self._inner.state.get(slot.piece) or None
            return
        master: SwappedMaster = self._master
        expected = iter(slots)
        for u, k, states in master.read_pieces():
            slot = next(expected, None)
            piece = master.pieces[u][k]
            if slot is None or slot.piece is not piece:
                raise InvalidStateError("the optimizer's sub-groups and the checkpoint layout list pieces in another order")
            state = self._inner.state.get(piece)
            if not state:
                yield slot, states[0], None
                continue
            yield slot, states[0], _swapped_state(state, self.rows(piece), lambda row: states[row])

    def frozen(self, slot: Slot) -> torch.Tensor:
        """A frozen parameter's or buffer's values."""
        group = slot.group
        if group is None or group.in_memory:
            return slot.data
        if self._group != group.index:
            self._group, self._shard = group.index, self._residency.read_shard(group.index)
        assert self._shard is not None
        return self._shard[slot.shard_start : slot.shard_start + slot.data.numel()]


def _swapped_state(state: dict, rows: dict[str, int], value_of: Any) -> dict:
    """A piece's state with its states on NVMe: its scalars, and each ranged
    state as ``value_of(row)`` gives it."""
    kept = {k: v for k, v in state.items() if k not in rows}
    return {**kept, **{k: value_of(rows[k]) for k in resting_keys(state, rows)}}
