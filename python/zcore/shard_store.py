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
The optimizer writes updated shards into ``local_shard`` wherever it is.
Staging tensors are allocated per fetch; the coordinator bounds their
total (CoordinatorConfig.staging_bytes).
"""

from __future__ import annotations

from typing import Optional

import torch

from zcore import _C
from zcore.errors import InvalidStateError
from zcore.sharded_group import ShardedGroup


class ShardStore:
    def __init__(self, groups: list[ShardedGroup], tiers: list[_C.ShardTier], pin: bool) -> None:
        """``tiers[g]``: the tier the coordinator put group g on; host shards
        move to host memory here (page-locked when ``pin``)."""
        self._groups = groups
        self._offloaded = [t != _C.ShardTier.DEVICE for t in tiers]
        for g, tier in zip(groups, tiers):
            if tier == _C.ShardTier.HOST:
                host = g.local_shard.to("cpu")
                g.local_shard = host.pin_memory() if pin else host
            elif tier != _C.ShardTier.DEVICE:
                raise InvalidStateError(f"group {g.index} is on tier {tier}, which this store cannot hold yet")
        self._staged: dict[int, torch.Tensor] = {}  # group -> its shard on the compute device
        self._copied: dict[int, Optional[torch.cuda.Event]] = {}  # group -> its copy in flight
        devices = {g.device for g in groups}
        cuda = next((d for d in devices if d.type == "cuda"), None)
        self._stream = torch.cuda.Stream(cuda) if cuda is not None and any(self._offloaded) else None

    def source(self, group: int) -> torch.Tensor:
        """The shard an all-gather of ``group`` reads now."""
        if not self._offloaded[group]:
            return self._groups[group].local_shard
        staged = self._staged.get(group)
        if staged is None or group in self._copied:
            raise InvalidStateError(
                f"group {group}'s shard rests off the device and is not staged there: the "
                "coordinator's plan must fetch it (and wait for it) before its all-gather"
            )
        return staged

    def fetch(self, group: int) -> None:
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
        if group not in self._copied:
            raise InvalidStateError(f"the plan waits for group {group}'s shard, which is not being fetched")
        event = self._copied.pop(group)
        if event is not None:
            torch.cuda.current_stream(self._groups[group].device).wait_event(event)

    def drop(self, group: int) -> None:
        del self._staged[group]
