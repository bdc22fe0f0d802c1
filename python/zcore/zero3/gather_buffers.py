"""Where gathered parameter groups live while they are gathered.

Non-persistent groups take a block of one zcore.Arena (host memory on CPU,
device memory on a GPU), sized for what the coordinator may keep live: the
live budget, the prefetch bucket and the largest group, capped by the total
size of those groups. Persistent groups (small, gathered for good) get plain
tensors of their own: kept in the arena they would pin its middle and
fragment it (bench/RESULTS.md, contiguous allocator). A request that does
not fit in the arena, or that would need a compaction while a running module
may hold views of a block (see ``take``), gets a plain tensor too, counted
as a fallback: training never fails for want of arena space.

Every buffer is flat, padded_numel elements of the group's dtype. Views of
an arena block go stale when the arena compacts (``Arena.generation``), so
callers re-derive them with ``current``.
"""

from __future__ import annotations

import bisect

from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from zcore.memory.arena import DEFAULT_ALIGNMENT, Arena, Block
from zcore.parallel.dtensor import local_tensor
from zcore.zero3.sharded_group import ShardedGroup


@dataclass
class BufferStats:
    arena_capacity: int = 0  # bytes
    arena_fallbacks: int = 0  # groups gathered outside the arena
    compactions: int = 0
    gathered_bytes: int = 0  # now: arena blocks + fallbacks + persistent buffers
    persistent_bytes: int = 0  # now
    peak_gathered_bytes: int = 0  # since construction or reset_peak()


def arena_capacity(groups: list[ShardedGroup], persistent: list[bool], max_live: int, bucket: int) -> int:
    """Bytes for the non-persistent groups' blocks: what the coordinator may
    keep live (one group larger than the live budget is still gathered
    alone), capped by all of them at once, plus each block's alignment."""
    sizes = [g.padded_numel * g.dtype.itemsize for g, p in zip(groups, persistent) if not p]
    if not sizes:
        return 0
    itemsize = max(g.dtype.itemsize for g in groups)
    wanted = (max_live + bucket) * itemsize + max(sizes)
    return _aligned(min(wanted, sum(sizes))) + DEFAULT_ALIGNMENT * len(sizes)


class GatherBuffers:
    def __init__(self, groups: list[ShardedGroup], persistent: list[bool], capacity: int) -> None:
        self.groups = groups
        self.persistent = persistent
        device = groups[0].device if groups else torch.device("cpu")
        self.arena: Optional[Arena] = None
        if capacity > 0:
            self.arena = (
                Arena.on_device(capacity, device) if device.type == "cuda" else Arena.on_host(capacity)
            )
        self._blocks: dict[int, Block] = {}  # group -> its arena block
        # group -> its buffer: a plain tensor (persistent or fallback) or a
        # view of its arena block at the block's current offset (re-derived
        # at compaction; ``current`` runs several times per gather).
        self._current: dict[int, torch.Tensor] = {}
        self._plain_ptrs: dict[int, int] = {}  # plain buffer's storage pointer -> group, for owner_of
        # Arena blocks by start byte, sorted, for owner_of's bisection: it
        # runs for every tensor autograd saves. Offsets only change when
        # the arena compacts, and then the index is rebuilt.
        self._starts: list[int] = []
        self._group_at: dict[int, int] = {}
        self._generation = self.arena.generation if self.arena is not None else 0
        self.stats = BufferStats(arena_capacity=capacity)

    def holds(self, group: int) -> bool:
        return group in self._current

    def would_compact(self, group: int) -> bool:
        """Whether taking ``group``'s buffer from the arena would move blocks."""
        if self.persistent[group] or self.arena is None:
            return False
        need = _aligned(self._nbytes(group))
        s = self.arena.stats()
        return s.largest_free < need <= s.free

    def take(self, group: int, allow_compaction: bool) -> tuple[torch.Tensor, bool]:
        """A buffer for ``group``; True with it when the arena compacted (so
        every other block moved: re-derive their views)."""
        # Never an inference tensor, nor a view made in inference mode: a
        # buffer gathered under torch.inference_mode() (an evaluation) may
        # stay gathered for a training forward, which saves it for backward.
        with torch.inference_mode(False), torch.no_grad():
            return self._take(group, allow_compaction)

    def _take(self, group: int, allow_compaction: bool) -> tuple[torch.Tensor, bool]:
        g = self.groups[group]
        nbytes = self._nbytes(group)
        moved = False
        if self.persistent[group]:
            buf = self._take_plain(group, persistent=True)
        elif self.arena is not None and self._fits(nbytes, allow_compaction):
            # Whole alignment units: every free range then starts and ends
            # aligned, so largest_free tells exactly whether a request fits.
            self._blocks[group] = self.arena.allocate((_aligned(nbytes) // g.dtype.itemsize,), g.dtype)
            moved = self.arena.generation != self._generation
            if moved:
                self._generation = self.arena.generation
                self.stats.compactions += 1
                self._index_blocks()
            else:
                self._index_block(group)
            buf = self.current(group)
        else:
            self.stats.arena_fallbacks += 1
            buf = self._take_plain(group, persistent=False)
        self.stats.gathered_bytes += nbytes
        self.stats.peak_gathered_bytes = max(self.stats.peak_gathered_bytes, self.stats.gathered_bytes)
        return buf, moved

    def give_back(self, group: int) -> None:
        nbytes = self._nbytes(group)
        buf = self._current.pop(group)
        block = self._blocks.pop(group, None)
        if block is not None:
            start = self.arena.offset(block)
            self._starts.pop(bisect.bisect_left(self._starts, start))
            del self._group_at[start]
            self.arena.free(block)
        else:
            del self._plain_ptrs[buf.untyped_storage().data_ptr()]
            if self.persistent[group]:
                self.stats.persistent_bytes -= nbytes
        self.stats.gathered_bytes -= nbytes

    def current(self, group: int) -> torch.Tensor:
        return self._current[group]

    def in_arena(self) -> list[int]:
        return list(self._blocks)

    def owner_of(self, t: torch.Tensor) -> Optional[tuple[int, int]]:
        """(group, element offset of ``t`` in the group's buffer) when ``t``
        views a gathered buffer, else None. A DTensor views one when its
        local tensor does; another wrapper without storage of its own
        (torch's async collective results) views none."""
        t = local_tensor(t)
        if is_traceable_wrapper_subclass(t):
            return None
        ptr = t.untyped_storage().data_ptr()
        group = self._plain_ptrs.get(ptr)
        if group is not None:
            return group, t.storage_offset()
        if not self._blocks or not self.arena.owns(t):
            return None
        byte = t.storage_offset() * t.element_size()
        i = bisect.bisect_right(self._starts, byte) - 1
        if i < 0:
            return None
        start = self._starts[i]
        group = self._group_at[start]
        if byte >= start + self._blocks[group].nbytes:
            return None
        return group, (byte - start) // t.element_size()

    def _index_block(self, group: int) -> None:
        block = self._blocks[group]
        start = self.arena.offset(block)
        bisect.insort(self._starts, start)
        self._group_at[start] = group
        self._current[group] = self._view(group, block)

    def _index_blocks(self) -> None:
        self._group_at = {self.arena.offset(b): g for g, b in self._blocks.items()}
        self._starts = sorted(self._group_at)
        for g, block in self._blocks.items():
            self._current[g] = self._view(g, block)

    def _view(self, group: int, block: Block) -> torch.Tensor:
        return self.arena.tensor(block)[: self.groups[group].padded_numel]

    def reset_peak(self) -> None:
        self.stats.peak_gathered_bytes = self.stats.gathered_bytes

    def _take_plain(self, group: int, persistent: bool) -> torch.Tensor:
        g = self.groups[group]
        buf = torch.empty(g.padded_numel, dtype=g.dtype, device=g.device)
        self._current[group] = buf
        self._plain_ptrs[buf.untyped_storage().data_ptr()] = group
        if persistent:
            self.stats.persistent_bytes += self._nbytes(group)
        return buf

    def _fits(self, nbytes: int, allow_compaction: bool) -> bool:
        s = self.arena.stats()
        need = _aligned(nbytes)
        return need <= s.largest_free or (allow_compaction and need <= s.free)

    def _nbytes(self, group: int) -> int:
        g = self.groups[group]
        return g.padded_numel * g.dtype.itemsize


def _aligned(nbytes: int) -> int:
    return -(-nbytes // DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT
