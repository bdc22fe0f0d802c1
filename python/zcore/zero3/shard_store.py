"""ZeRO-3: where each rank's parameter shards rest between uses, and the
staged copies that all-gathers read.

The native coordinator decides each group's tier (zcore._C.ShardTier) and,
in its plans, when a shard moves; ``ShardStore`` does the moving:
- DEVICE: the shard is the group's ``local_shard`` on the compute device;
  the all-gather reads it in place.
- HOST: ``local_shard`` lives in host memory (page-locked on a GPU machine,
  when asked). FETCH_SHARD copies it into a staging tensor on the compute
  device (on CUDA, on a copy stream of its own, so the copy overlaps
  compute and the all-gathers), SHARD_READY makes the current stream wait
  for that copy, DROP_SHARD lets the staging tensor go.
- NVME: the shard is in this rank's parameter swap file (zcore.memory.swap), keyed
  by group; the group holds no tensor. FETCH_SHARD starts reading it into a
  host buffer of the swap manager's pool (on a CPU compute device that
  buffer is the staged shard), SHARD_READY waits for the read (and, on
  CUDA, copies it to the device), DROP_SHARD returns the buffer. Updated
  shards come in through ``write``; STORE_SHARD starts writing one out and
  SHARD_STORED waits for it, so a shard is read again only once written.
Device and host shards are written in place. Staging tensors are allocated
per fetch; the coordinator bounds their total (CoordinatorConfig.staging_bytes),
and the swap manager's pool the host buffers of NVMe reads.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

import zcore._C as _C
from zcore import tracing
from zcore.errors import InvalidStateError
from zcore.zero3.sharded_group import ShardedGroup
from zcore.memory.swap import SwapManager
from zcore.tracing import Wait


class ShardStore:
    def __init__(
        self,
        groups: list[ShardedGroup],
        tiers: list[_C.ShardTier],
        pin: bool,
        open_swap: Optional[Callable[[], SwapManager]] = None,
    ) -> None:
        """``tiers[g]``: the tier the coordinator put group g on; ``place``
        moves each group's shard there: host shards to host memory
        (page-locked when ``pin``), NVMe shards to a swap file that
        ``open_swap()`` creates."""
        self._groups = groups
        self._tiers = tiers
        self._pin = pin
        self._open_swap = open_swap
        on_nvme = any(t == _C.ShardTier.NVME for t in tiers)
        if on_nvme and open_swap is None:
            raise InvalidStateError("parameter shards go to NVMe, but no swap space was given")
        self._swap = open_swap() if on_nvme and open_swap is not None else None
        self._staged: dict[int, torch.Tensor] = {}  # group -> its shard where the all-gather reads it
        self._copied: dict[int, Optional[torch.cuda.Event]] = {}  # group -> its host copy in flight
        self._reading: dict[int, torch.Tensor] = {}  # group -> the host buffer its NVMe read fills
        self._incoming: dict[int, torch.Tensor] = {}  # group -> updated values not yet stored
        self._writing: dict[int, torch.Tensor] = {}  # group -> values being written
        devices = {g.device for g in groups}
        cuda = next((d for d in devices if d.type == "cuda"), None)
        hosted = any(t == _C.ShardTier.HOST for t in tiers)
        self._stream = torch.cuda.Stream(cuda) if cuda is not None and hosted else None

    def tier(self, group: int) -> _C.ShardTier:
        return self._tiers[group]

    def place(self, group: int, values: torch.Tensor) -> None:
        """``values`` become ``group``'s first shard, on its tier (cast to
        the group's dtype)."""
        g = self._groups[group]
        tier = self._tiers[group]
        if tier == _C.ShardTier.NVME:
            self._swap_out_now(group, values.to(g.dtype))
        elif tier == _C.ShardTier.HOST:
            host = values.to(device="cpu", dtype=g.dtype)
            g.local_shard = host.pin_memory() if self._pin else host
        else:
            g.local_shard = values.to(device=g.device, dtype=g.dtype)

    def source(self, group: int) -> torch.Tensor:
        """The shard an all-gather of ``group`` reads now."""
        if self._tiers[group] == _C.ShardTier.DEVICE:
            return self._groups[group].local_shard
        staged = self._staged.get(group)
        if staged is None or group in self._copied or group in self._reading:
            raise InvalidStateError(
                f"group {group}'s shard rests off the device and is not staged there: the "
                "coordinator's plan must fetch it (and wait for it) before its all-gather"
            )
        return staged

    # The coordinator's actions.
    def fetch(self, group: int) -> None:
        if self._tiers[group] == _C.ShardTier.NVME:
            self._reading[group] = self._nvme().swap_in(group)
            return
        g = self._groups[group]
        staged = torch.empty(g.shard_numel, dtype=g.dtype, device=g.device)
        if self._stream is None:
            staged.copy_(g.local_shard)
            self._copied[group] = None
        else:
            # The copy stream must not read the shard before the optimizer's
            # last write to it, queued on the current stream, is done.
            self._stream.wait_stream(torch.cuda.current_stream(g.device))
            with torch.cuda.stream(self._stream):
                staged.copy_(g.local_shard, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            # Allocated on the current stream, used on the copy stream.
            staged.record_stream(self._stream)
            self._copied[group] = event
        self._staged[group] = staged

    def ready(self, group: int) -> None:
        if group in self._reading:
            self._nvme().wait(group)
            host = self._reading.pop(group)
            device = self._groups[group].device
            # The pool buffer goes back once copied: a synchronous copy.
            if device.type == "cpu":
                self._staged[group] = host
            else:
                with tracing.waiting(Wait.COPY):
                    self._staged[group] = host.to(device)
            return
        if group not in self._copied:
            raise InvalidStateError(f"the plan waits for group {group}'s shard, which is not being fetched")
        event = self._copied.pop(group)
        if event is not None:
            torch.cuda.current_stream(self._groups[group].device).wait_event(event)

    def drop(self, group: int) -> None:
        del self._staged[group]

    def store(self, group: int) -> None:
        values = self._incoming.pop(group, None)
        if values is None:
            raise InvalidStateError(f"the plan stores group {group}'s shard, but no new values were written")
        self._writing[group] = values
        self._nvme().swap_out(group, values)

    def stored(self, group: int) -> None:
        try:
            self._nvme().wait(group)
        finally:
            del self._writing[group]

    # Shard values outside the plans (optimizer, checkpoints, GatheredParameters).
    def read(self, group: int) -> torch.Tensor:
        """``group``'s shard values now: the resident shard itself (writes to
        it are the shard's), or a host copy read from NVMe."""
        if self._tiers[group] != _C.ShardTier.NVME:
            return self._groups[group].local_shard
        pending = self._incoming.get(group, self._writing.get(group))
        if pending is not None:
            return pending.clone()
        swap = self._nvme()
        values = swap.swap_in(group)
        swap.wait(group)
        return values

    def write(self, group: int, values: torch.Tensor) -> bool:
        """Takes ``values`` as ``group``'s shard. True when the shard rests on
        NVMe: the values are kept (the caller must not change them) until the
        coordinator's STORE_SHARD and SHARD_STORED for the group ran."""
        if self._tiers[group] != _C.ShardTier.NVME:
            self._groups[group].local_shard.copy_(values)
            return False
        if group in self._incoming:
            raise InvalidStateError(f"group {group}'s shard was written twice without being stored in between")
        shard = self._groups[group]
        self._incoming[group] = values.detach().to(device="cpu", dtype=shard.dtype, copy=True).contiguous()
        return True

    @property
    def pending_bytes(self) -> int:
        """Bytes of updated NVMe shards held until their writes finish."""
        held = [*self._incoming.values(), *self._writing.values()]
        return sum(t.numel() * t.element_size() for t in held)

    def swap_stats(self) -> Optional[_C.SwapStats]:
        """The swap file's counters (bytes used, swapped in and out); None
        when no shard rests on NVMe."""
        return None if self._swap is None else self._swap.stats()

    def close(self) -> None:
        """Removes the swap file (the shards on NVMe are gone)."""
        if self._swap is not None:
            self._swap.close()

    # Checkpoint loads: new NVMe shards written aside, then adopted at once.
    def new_swap(self) -> SwapManager:
        """An empty swap file like this store's, for ``adopt`` (keys: groups)."""
        if self._open_swap is None or self._swap is None:
            raise InvalidStateError("no group of this store rests on NVMe")
        return self._open_swap()

    def adopt(self, swap: SwapManager) -> None:
        """``swap`` (from ``new_swap``, holding every NVMe group's shard)
        becomes the store's; the old swap file is removed. Only between
        steps, with no shard staged and no write in flight."""
        if self._staged or self._reading or self._incoming or self._writing:
            raise InvalidStateError("the shard store changes swap files only between steps, with no I/O in flight")
        old, self._swap = self._swap, swap
        if old is not None:
            old.close()

    def _swap_out_now(self, group: int, shard: torch.Tensor) -> None:
        swap = self._nvme()
        swap.swap_out(group, shard.detach().to("cpu").contiguous())
        swap.wait(group)

    def _nvme(self) -> SwapManager:
        if self._swap is None:
            raise InvalidStateError("no group of this store rests on NVMe")
        return self._swap
