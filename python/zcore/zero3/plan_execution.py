"""ZeRO-3: executes the native coordinator's plans on the groups' buffers.

The coordinator (zcore._C.ParamCoordinator, protocol in
cpp/include/zcore/coordinator.h) answers each use site's entry and exit
with a plan; ``PlanExecutor`` does what it says: one asynchronous
all-gather of a group's shard into a buffer per GATHER (of its secondary
within a block of ranks under hpZ: zcore.zero3.secondary_partition), parameters pointed
at views of the buffer at WAIT, pointed away and the buffer returned at
RELEASE; a shard resting off the device (zcore.zero3.shard_store) is copied to
it at FETCH_SHARD, waited for at SHARD_READY and let go at DROP_SHARD; an
updated NVMe shard is written at STORE_SHARD and waited for at SHARD_STORED.
An action it does not know is an error, never a guess.

The coordinator applies each action's transition when it issues the plan,
so while a plan runs its states are already those after the plan. What has
really happened so far (an all-gather issued and not yet waited for) is
Python's to know: each group's ``_GroupSlot`` holds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

import zcore._C as _C
from zcore.comm import collectives as comm
from zcore.errors import InvalidStateError
from zcore.zero3.gather_buffers import GatherBuffers
from zcore.zero3.recording_checks import RankAgreement, signature
from zcore.zero3.secondary_partition import WeightGathers
from zcore.zero3.shard_store import ShardStore
from zcore.zero3.sharded_group import ShardedGroup
from zcore.comm.topology import RankGroup
from zcore.zero3.use_sites import UseSites


# The actions that read a group's shard: after an optimizer step running
# behind the forward, they wait for the group's update.
_READS_SHARD = (_C.Action.GATHER, _C.Action.FETCH_SHARD)


@dataclass(frozen=True)
class _InFlight:
    """An all-gather into a group's buffer, issued and not yet waited for."""

    work: Optional[Any]  # torch's Work; None once waited (compaction) or at world size 1


@dataclass
class _GroupSlot:
    """What Python holds for one group between the coordinator's actions."""

    group: ShardedGroup
    gather: Optional[_InFlight] = None


class PlanExecutor:
    def __init__(
        self,
        coordinator: _C.ParamCoordinator,
        groups: list[ShardedGroup],
        buffers: GatherBuffers,
        store: ShardStore,
        sites: UseSites,
        shard: RankGroup,
        check_every_module: bool,
        gathers: WeightGathers,
        data_parallel: RankGroup,
    ) -> None:
        """``check_every_module``: ranks agree on every use, not only on the
        uses no trace foresaw (config stage3_rank_agreement_check).
        ``shard``: the ranks each group's shards spread over (the world, or
        a MiCS shard group). ``gathers``: how a group's all-gather goes,
        over them or (hpZ) within a block of ranks (zcore.zero3.secondary_partition).
        ``data_parallel``: the ranks whose agreement is checked (every
        data-parallel rank runs the same modules)."""
        self.coordinator = coordinator
        self.buffers = buffers
        self._store = store
        self.shard = shard
        self._slots = [_GroupSlot(g) for g in groups]
        self._sites = sites
        self._agreement = RankAgreement(groups[0].device, data_parallel) if data_parallel.size > 1 and groups else None
        self._check_every_module = check_every_module
        self._gathers = gathers
        self._entering: list[int] = []  # groups of the site being entered
        # While an optimizer step runs behind the forward (publish_behind):
        # waits until a group's update is complete; the trained persistent
        # groups whose gathered values predate it.
        self._wait_update: Optional[Callable[[int], None]] = None
        self._stale: set[int] = set()
        self._actions: dict[Any, Callable[[int], None]] = {
            _C.Action.GATHER: self._start_gather,
            _C.Action.WAIT: self._finish_gather,
            _C.Action.RELEASE: self._release,
            _C.Action.FETCH_SHARD: store.fetch,
            _C.Action.SHARD_READY: store.ready,
            _C.Action.DROP_SHARD: store.drop,
            _C.Action.STORE_SHARD: store.store,
            _C.Action.SHARD_STORED: store.stored,
        }

    def enter(self, site: int) -> None:
        """Before a use: its groups gathered (and the prefetch started)."""
        if self._agreement is not None and (self._check_every_module or self.coordinator.unforeseen(site)):
            # Before any gather: ranks that disagree here would hang in it.
            groups = self.coordinator.module_groups(site)
            self._agreement.check(signature(groups), lambda: f"{self._sites.name(site)} (groups {list(groups)})")
        self._entering = self.coordinator.module_groups(site)
        try:
            if self._stale:
                self._refresh_stale([g for g in self._entering if g in self._stale])
            self.execute(self.coordinator.before_module(site))
        finally:
            self._entering = []

    def leave(self, site: int) -> None:
        self.execute(self.coordinator.after_module(site))

    def agree(self, what: int, describe: Callable[[], str]) -> None:
        """Every rank has reached ``what`` (a signature), when ranks are checked here."""
        if self._agreement is not None and (self._check_every_module or self.coordinator.recording):
            self._agreement.check(what, describe)

    def execute(self, plan: list) -> None:
        for action, group in plan:
            run = self._actions.get(action)
            if run is None:
                raise InvalidStateError(
                    f"the coordinator planned {action!r} for group {group}, an action this package "
                    "does not know: zcore._C and the Python package come from different builds; "
                    "reinstall zcore",
                    group=group,
                )
            if self._wait_update is not None and action in _READS_SHARD:
                self._wait_update(group)
            run(group)

    def defer_refresh(self, wait_update: Callable[[int], None], trained: list[ShardedGroup]) -> None:
        """An optimizer step goes on behind the forward: shards are read
        once ``wait_update(group)`` returns, and the trained persistent
        groups take their new values at their next use."""
        self._wait_update = wait_update
        self._stale |= {g.index for g in trained if self.buffers.persistent[g.index] and self.buffers.holds(g.index)}

    def end_wait(self) -> None:
        """The step is complete: nothing more to wait for (the stale groups
        are still refreshed at their next use)."""
        self._wait_update = None

    def refresh_all(self, groups: list[ShardedGroup]) -> None:
        """``refresh``, after which no group is stale."""
        self.refresh(groups)
        self._stale = set()

    def _refresh_stale(self, groups: list[int]) -> None:
        if self._wait_update is not None:
            for g in groups:
                self._wait_update(g)
        self.refresh([self._slots[g].group for g in groups])
        self._stale.difference_update(groups)

    def gathered(self, group: int) -> bool:
        """Whether ``group``'s buffer holds its full parameters now."""
        return self.buffers.holds(group) and self._slots[group].gather is None

    def refresh(self, groups: list[ShardedGroup]) -> None:
        """The persistent groups among ``groups`` that are gathered take
        their shards' new values in place."""
        stale = [g for g in groups if self.buffers.persistent[g.index] and self.buffers.holds(g.index)]
        if not stale:
            return
        if self.shard.size == 1:
            for g in stale:
                self.buffers.current(g.index).copy_(g.local_shard)
            return
        # Frozen and trained groups may differ in dtype: one all-gather per dtype.
        for dtype in dict.fromkeys(g.dtype for g in stale):
            self._all_gather_into_place([g for g in stale if g.dtype == dtype])

    def _all_gather_into_place(self, stale: list[ShardedGroup]) -> None:
        send = torch.cat([g.local_shard for g in stale])
        recv = torch.empty(self.shard.size * send.numel(), dtype=send.dtype, device=send.device)
        comm.all_gather_into(recv, send, group=self.shard.group)
        recv = recv.view(self.shard.size, -1)
        start = 0
        for g in stale:
            full = self.buffers.current(g.index).view(self.shard.size, g.shard_numel)
            full.copy_(recv[:, start : start + g.shard_numel])
            start += g.shard_numel

    def _start_gather(self, group: int) -> None:
        compacts = self.buffers.would_compact(group)
        allow = compacts and self._compaction_is_safe()
        if allow:
            # Compaction moves blocks: no all-gather may still be writing.
            for slot in self._slots:
                if slot.gather is not None and slot.gather.work is not None:
                    slot.gather.work.wait()
                    slot.gather = _InFlight(None)
        buf, moved = self.buffers.take(group, allow_compaction=allow)
        if moved:
            for other in self.buffers.in_arena():
                if other != group and self._slots[other].gather is None:
                    self._slots[other].group.point_params_at(self.buffers.current(other))
        slot = self._slots[group]
        shard = self._store.source(group)
        if self.shard.size == 1:
            buf.copy_(shard)
            slot.gather = _InFlight(None)
        else:
            slot.gather = _InFlight(self._gathers.start(group, buf, shard))

    def _compaction_is_safe(self) -> bool:
        """A running module may hold views of its groups' buffers in local
        variables (``w = self.weight.t()`` before calling a child), which a
        compaction would leave pointing at moved bytes: compact only when no
        arena group is in use but by the module being entered (which has not
        run yet)."""
        c = self.coordinator
        return all(
            c.state(g) != _C.GroupState.IN_USE or (g in self._entering and c.use_count(g) == 1)
            for g in self.buffers.in_arena()
        )

    def _finish_gather(self, group: int) -> None:
        slot = self._slots[group]
        if slot.gather is None:
            raise InvalidStateError(f"the coordinator planned a wait for group {group}, which is not being gathered")
        if slot.gather.work is not None:
            slot.gather.work.wait()
        slot.gather = None
        full = self.buffers.current(group)
        self._gathers.done(group, full)
        slot.group.point_params_at(full)

    def _release(self, group: int) -> None:
        self._slots[group].group.release_params()
        self.buffers.give_back(group)
