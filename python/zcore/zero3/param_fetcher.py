"""ZeRO-3 at run time: the object the engine and the hooks talk to.

``ParamFetcher`` is a thin facade over the parts of stage 3 that run during
a step, each in its own module:
- zcore.zero3.plan_execution: the native coordinator's plans executed on the
  groups' buffers (all-gathers, waits, releases, compaction);
- zcore.zero3.module_calls: the calls of hooked modules, forward and backward,
  with activation checkpointing's recomputations;
- zcore.zero3.saved_views: tensors autograd saves that view gathered buffers;
- zcore.zero3.external_params: parameters used outside their module;
- zcore.zero3.leaf_reductions: when a leaf module's gradients may be reduced;
- zcore.zero3.use_sites: the coordinator modules entered and left, and names;
- zcore.zero3.secondary_partition: where all-gathers go (hpZ: within a block of
  ranks, from secondaries kept after a gather over the world).

A step is one forward and its backward (one trace: backward continues it),
or several forwards and their backwards where forwards run before earlier
ones' backwards (zcore.zero3.pending_backwards). Forward with grad enabled uses
trace key TRAIN, without grad (evaluation, generation) key NO_GRAD; a
no-grad step ends when its forward returns, a training step when the
engine's backward has run and no forward awaits its own, or at the next
forward if no backward came, or at the latest before the optimizer step.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass, fields
from typing import Any, Callable, Optional

import torch
from torch.utils.checkpoint import set_checkpoint_early_stop

import zcore._C as _C
from zcore.comm import collectives as comm
from zcore.zero3.external_params import ExternalParameters
from zcore.errors import ConfigError
from zcore.zero3.gather_buffers import BufferStats, GatherBuffers, arena_capacity
from zcore.zero3.leaf_modules import z3_leaf_module
from zcore.zero3.leaf_reductions import LeafReductions
from zcore.memory.host_memory import PAGE_ALIGNMENT
from zcore.zero3.module_calls import CallTracker, ModuleCall
from zcore.zero3.pending_backwards import PendingBackwards
from zcore.zero3.plan_execution import PlanExecutor
from zcore.config.policies import CommPolicy, OffloadPolicy, Tier
from zcore.zero3.recording_checks import END_OF_STEP, ReleasedParameterCheck
from zcore.zero3.saved_views import SavedViews, hooks_in_force
from zcore.zero3.secondary_partition import weight_gathers
from zcore.zero3.shard_store import ShardStore
from zcore.zero3.sharded_group import ShardedGroup
from zcore.memory.swap import SwapManager
from zcore.comm.topology import RankGroup, Topology
from zcore.zero3.use_sites import ModelNames, UseSites

log = logging.getLogger("zcore")

TRAIN, NO_GRAD = 0, 1  # trace keys


@dataclass(frozen=True)
class GatherStats:
    """Coordinator statistics (elements), gathered-buffer figures (bytes) and hpZ's."""

    steps: int
    gathers: int
    bytes_gathered: int
    prefetch_gathers: int
    prefetch_hits: int
    prefetch_misses: int
    resident_hits: int
    trace_departures: int
    trace_recordings: int
    live_elements: int
    peak_live_elements: int
    shard_fetches: int  # offloaded shards copied to the device (parameter offload)
    shard_fetches_ahead: int  # of those, started ahead of the use's plan
    staged_bytes: int  # offloaded shards on the device now
    peak_staged_bytes: int
    arena_capacity: int
    arena_fallbacks: int
    compactions: int
    gathered_bytes: int
    persistent_bytes: int
    peak_gathered_bytes: int
    secondary_gathers: int  # gathers within the hpZ block, from secondaries
    secondary_bytes: int  # hpZ secondaries held now


class ParamFetcher:
    def __init__(
        self,
        model: torch.nn.Module,
        groups: list[ShardedGroup],
        modules: list[tuple[torch.nn.Module, list[int]]],
        config: _C.CoordinatorConfig,
        shard: RankGroup,
        offload: OffloadPolicy,
        check_every_module: bool = False,
        swap: Optional[Callable[[int, int], SwapManager]] = None,
        comm_policy: CommPolicy = CommPolicy(),
        topology: Optional[Topology] = None,
        data_parallel: Optional[RankGroup] = None,
    ) -> None:
        """``modules``: every module with parameters and the groups it needs;
        ``model`` is hooked too, with no groups of its own if it has no
        parameters, so that a parameter it takes from a child has a
        module to be gathered for (note "external parameters").
        ``check_every_module``: ranks agree on every use, not only on the
        uses no trace foresaw (config stage3_rank_agreement_check).
        ``offload.parameters``: the tier of every group's shard (persistent
        groups stay on the device, and NVMe shards within
        ``offload.nvme_host_elements`` in host memory); ``swap(capacity,
        host_bytes)`` opens the
        swap file of NVMe shards, with a host pool of ``host_bytes`` for reads.
        ``shard``: the ranks each group's shards spread over (the world, or
        a MiCS shard group); ``data_parallel``: the ranks that must run the
        same modules (default: the world; zcore.parallel.mesh's "dp"). ``comm_policy``: all-gathers in int8 (ZeRO++
        qwZ), in two levels (MiCS), and (hpZ) within blocks of ranks from a
        secondary partition: the last two collective, every rank creates
        the groups ``topology`` gives."""
        self.groups = groups
        self.shard = shard
        tier = _TIERS[offload.parameters]
        if tier != _C.ShardTier.DEVICE:
            config.staging_bytes = staging_bytes(groups, config, shard.size, offload)
        config.nvme_host_elements = offload.nvme_host_elements
        self.coordinator = _C.ParamCoordinator(config)
        for g in groups:
            self.coordinator.register_group(
                g.padded_numel, g.dtype.itemsize, shard_numel=g.shard_numel, tier=tier
            )
        tiers = [self.coordinator.shard_tier(g.index) for g in groups]
        on_nvme = [g for g, t in zip(groups, tiers) if t == _C.ShardTier.NVME]
        open_swap = None
        if on_nvme and swap is not None:
            open_swap = functools.partial(
                swap, swap_capacity(on_nvme), nvme_host_bytes(on_nvme, config.staging_bytes)
            )
        self._store = ShardStore(groups, tiers, offload.pin_parameters, open_swap)
        self._finish_update: Optional[Callable[[], None]] = None  # publish_behind
        # Updated NVMe shards held for writing, at most this many bytes at once.
        self._pending_limit = config.staging_bytes
        self.group_of_param = {id(p): g.index for g in groups for p in g.params}
        self._names = ModelNames(model, groups, self.group_of_param)
        self._sites = UseSites(self.coordinator, self._names)
        for module, ids in modules:
            self._sites.add_module(module, ids)
        if self._sites.index(model) is None:
            self._sites.add_module(model, [])
        persistent = [self.coordinator.persistent(g.index) for g in groups]
        capacity = arena_capacity(groups, persistent, config.max_live_elements, config.prefetch_bucket_elements)
        self.buffers = GatherBuffers(groups, persistent, capacity)
        self.gathers = weight_gathers(comm_policy, shard, persistent, topology)
        self.data_parallel = data_parallel if data_parallel is not None else RankGroup.world()
        self._plans = PlanExecutor(
            self.coordinator, groups, self.buffers, self._store, self._sites, shard, check_every_module,
            self.gathers, self.data_parallel,
        )
        self._leaves = LeafReductions(self._leaf_groups(modules))
        self._calls = CallTracker(self._plans, groups, self._leaves.left)
        self._pending = PendingBackwards()
        self._told_open_at_update = False
        self._saved = SavedViews(self.buffers, self.group_of_param, self._plans.gathered, self._names.shapes_of)
        self._external = ExternalParameters(
            self._sites, self._plans, self._calls, self.buffers, self.group_of_param, self._names
        )
        self._master_writer: Optional[Callable[[ShardedGroup, torch.Tensor], None]] = None
        self._external_adopter: Optional[Callable[[torch.nn.Module, torch.nn.Parameter], None]] = None
        self._released_check = ReleasedParameterCheck(
            self._released, self._names.param, self._describe_module, self._adopt_external
        )
        self._units: set[int] = set()  # hooked modules that run compiled (add_unit)

    @property
    def modules(self) -> list[torch.nn.Module]:
        """Hooked module k, as the hooks know it."""
        return self._sites.modules

    # The engine's side: steps.
    def forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        grad = torch.is_grad_enabled()
        # Forwards still awaiting their backward: this one joins their step.
        joins = self.coordinator.in_step and self._pending.any()
        if not joins:
            if self.coordinator.in_step:
                self.end_step()  # the previous forward had no backward
            self.coordinator.begin_step(TRAIN if grad else NO_GRAD)
        # A key's first step records its trace: check every operator then.
        # Not with compiled units: Dynamo would trace the check's torch
        # function mode into their graphs, and recompile them once it is gone.
        recording = self.coordinator.recording and not self._units
        check = self._released_check if recording else contextlib.nullcontext()
        try:
            with (
                self._saved.composed_with(hooks_in_force()),
                torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack),
                set_checkpoint_early_stop(False),
                check,
            ):
                out = module(*args, **kwargs)
        except BaseException as exc:
            self.abort_after(exc)
            raise
        if grad:
            self._pending.add(out)
        elif not joins:
            self.end_step()
        return out

    def after_backward(self) -> None:
        """Ends the step unless a forward still awaits its backward."""
        if not self._pending.any():
            self.end_step()

    def before_update(self) -> None:
        """The optimizer is about to update the shards: a step still open
        (a forward whose outputs are kept but never back-propagated) ends,
        so that no gathered copy outlives the update. Ranks need not agree
        here: the update is the same point on every rank."""
        if not self.coordinator.in_step:
            return
        if not self._told_open_at_update:
            self._told_open_at_update = True
            log.info(
                "zcore ZeRO-3: a forward's outputs still await their backward at the optimizer step; "
                "its step ends there (a backward through them later would use the updated parameters). "
                "Said once."
            )
        self._close_step()

    def end_step(self) -> None:
        """After backward: closes the module calls whose inputs took no
        gradient (their backward post-hook never fires), then ends the step."""
        if not self.coordinator.in_step:
            return
        try:
            self._plans.agree(END_OF_STEP, lambda: "the end of the step")
        except BaseException as exc:
            self.abort_after(exc)
            raise
        self._close_step()

    def _close_step(self) -> None:
        self._pending.clear()
        self._calls.end_step()
        self._leaves.end_step()
        self._plans.execute(self.coordinator.end_step())
        notice = self.coordinator.take_departure_notice()
        if notice is not None:
            log.info(
                "zcore ZeRO-3: step %d (trace %d) left its recorded module order at use %d "
                "(expected group %d, got %d); gathering on demand and recording the new order. "
                "Said once until the order is stable again.",
                notice.step, notice.trace_key, notice.position, notice.expected, notice.actual,
            )

    def abort(self) -> None:
        self._pending.clear()
        self._calls.abort()
        self._leaves.end_step()
        self._plans.execute(self.coordinator.abort_step())

    def abort_after(self, exc: BaseException) -> None:
        """Aborts the step that ``exc`` interrupted. The abort's own failure
        (a read that never started cannot be waited for) is noted on
        ``exc``, which stays the error the caller sees."""
        try:
            self.abort()
        except Exception as failed:  # noqa: BLE001 - reported on exc
            exc.add_note(f"aborting the step then failed too: {type(failed).__name__}: {failed}")

    def publish(self) -> None:
        """After an optimizer step: the updated NVMe shards are on disk (a
        write error surfaces here), the trained groups that stay
        gathered (persistent ones) get the new values in place, in one
        all-gather, and the others' hpZ secondaries are dropped."""
        self.finish_writes()
        trained = [g for g in self.groups if g.trainable]
        self.gathers.drop(g.index for g in trained)
        self._plans.refresh_all(trained)

    def publish_behind(self, wait_update: Callable[[int], None], finish_update: Callable[[], None]) -> None:
        """After an optimizer step that goes on behind the forward
        (zcore.step.background_step): each group's shard is read once
        ``wait_update(group)`` returns, the persistent groups take their new
        values at their next use, and what needs every shard calls
        ``finish_update()`` first, which ends with ``update_complete()``.
        The trained groups' hpZ secondaries are dropped: their next gathers
        read the updated shards."""
        trained = [g for g in self.groups if g.trainable]
        self.gathers.drop(g.index for g in trained)
        self._plans.defer_refresh(wait_update, trained)
        self._finish_update = finish_update

    def update_complete(self) -> None:
        self._plans.end_wait()
        self._finish_update = None

    def place_shard(self, group: ShardedGroup, values: torch.Tensor) -> None:
        """At start-up: ``values`` become the group's shard, on its tier."""
        self._store.place(group.index, values)

    def read_shard(self, group: int) -> torch.Tensor:
        """``group``'s shard values (zcore.zero3.shard_store.ShardStore.read)."""
        self.finish_update()
        return self._store.read(group)

    def finish_update(self) -> None:
        """Waits for an optimizer step going on behind the forward, if any."""
        if self._finish_update is not None:
            self._finish_update()

    def write_shard(self, group: int, values: torch.Tensor) -> None:
        """Between steps: ``values`` become ``group``'s shard. An NVMe shard
        starts being written; the writes held in host memory stay within the
        staging budget (the oldest are waited for beyond it)."""
        if self._store.write(group, values):
            self._plans.execute(self.coordinator.store_shards([group]))
            if self._store.pending_bytes > self._pending_limit:
                self.finish_writes()

    def new_parameter_swap(self) -> SwapManager:
        """An empty swap file for the NVMe shards a checkpoint load stages (keys: groups)."""
        return self._store.new_swap()

    def adopt_parameter_swap(self, swap: SwapManager) -> None:
        """The staged NVMe shards become the groups' (a load's commit)."""
        self.finish_writes()
        self._store.adopt(swap)

    def shard_tier(self, group: int) -> _C.ShardTier:
        return self._store.tier(group)

    def persistent(self, group: int) -> bool:
        """Whether ``group`` stays gathered on the device between uses (its
        shard then stays on the device too, whatever the offload policy)."""
        return self.buffers.persistent[group]

    def parameter_swap_bytes(self) -> int:
        """Bytes the NVMe shards take in this rank's swap file (extents
        rounded to the I/O alignment); 0 when no shard rests on NVMe."""
        stats = self._store.swap_stats()
        return 0 if stats is None else stats.used

    def parameter_swap_stats(self) -> Optional[_C.SwapStats]:
        """The parameter swap file's counters (bytes swapped in and out since
        start-up, bytes used, ...); None when no shard rests on NVMe."""
        return self._store.swap_stats()

    def finish_writes(self) -> None:
        self._plans.execute(self.coordinator.finish_stores())

    def close(self) -> None:
        """Waits for the shard writes and removes the parameter swap file."""
        try:
            self.finish_writes()
        finally:
            self._store.close()

    def reload(self) -> None:
        """After a checkpoint load replaced the shards: every group that
        stays gathered, trained or frozen, gets the new values, and every
        hpZ secondary is dropped."""
        self.gathers.drop(g.index for g in self.groups)
        self._plans.refresh_all(self.groups)

    # The hooks' side: module calls.
    def enter_forward(self, k: int) -> ModuleCall:
        call = self._calls.enter_forward(k, self._sites.site(k))
        self._leaves.entered(call, torch.is_grad_enabled())
        return call

    def exit_forward(self, k: int, returned: list[torch.Tensor]) -> Optional[ModuleCall]:
        """``returned``: the tensors in hooked module ``k``'s output. None
        where no call of ``k`` runs: it was hooked during its own forward
        (zcore.register_external_parameter there), after entering it."""
        call = self._calls.running()
        if call is None or call.index != k:
            return None
        return self._calls.exit_forward(lambda caller: self._external.hand_over(returned, caller))

    def enter_backward(self, call: ModuleCall) -> None:
        self._calls.enter_backward(call)

    def exit_backward(self, call: ModuleCall) -> None:
        self._calls.exit_backward(call)

    def exit_backward_after_grads(self, call: ModuleCall) -> None:
        """``call``'s inputs need no gradient, so nothing marks the end of
        its backward but the gradients of its trained parameters: all of
        its backward nodes lead to them (note "backward without input
        gradients" in zcore.engine.hooks). A leaf module's call stays in
        backward until the step ends instead: which of its parameters get
        gradients differs by rank (note "leaf gradients" in
        zcore.zero3.leaf_reductions)."""
        if not self._leaves.is_leaf(call.index):
            self._calls.exit_backward_after_grads(call)

    def grad_accumulated(self, param: torch.Tensor) -> None:
        """Autograd accumulates a parameter's gradient once per backward,
        after every use's contribution: no call waiting for it needs it more."""
        self._calls.grad_accumulated(param)

    # Saved tensors (zcore.zero3.saved_views); attributes, so that a test can do without them.
    def pack(self, t: torch.Tensor) -> Any:
        return self._saved.pack(t)

    def unpack(self, saved: Any) -> torch.Tensor:
        return self._saved.unpack(saved)

    # Use sites outside the module hooks (GatheredParameters, register_external_parameter).
    def site_for(self, group_ids: list[int]) -> int:
        return self._sites.for_groups(group_ids)

    def gather_site(self, site: int) -> None:
        self._plans.enter(site)

    def release_site(self, site: int) -> None:
        self._plans.leave(site)

    def module_index(self, module: torch.nn.Module) -> Optional[int]:
        return self._sites.index(module)

    def add_module(self, module: torch.nn.Module, group_ids: list[int]) -> int:
        """A module to hook, needing ``group_ids``; returns its index k."""
        return self._sites.add_module(module, group_ids)

    def add_to_module(self, k: int, group: int, hooked_now: bool = False) -> None:
        """Hooked module ``k`` also needs ``group`` from now on; ``hooked_now``:
        ``k`` was just added (zcore.zero3.external_params.ExternalParameters.declare)."""
        self._external.declare(k, group, hooked_now)

    def leaf_groups(self) -> list[int]:
        """The trained groups whose gradients are reduced only once their
        leaf module's calls have left backward (zcore.zero3.leaf_reductions)."""
        return self._leaves.held_groups()

    def set_leaf_release(self, release: Callable[[list[int]], None]) -> None:
        """``release(groups)``: the reducer may reduce these leaf groups now."""
        self._leaves.set_release(release)

    def _leaf_groups(self, modules: list[tuple[torch.nn.Module, list[int]]]) -> dict[int, list[int]]:
        """Per hooked leaf module: the trained groups its subtree owns."""
        found = {}
        for module, ids in modules:
            if z3_leaf_module(module):
                subtree = {id(p) for p in module.parameters()}
                found[self._sites.index(module)] = [
                    g for g in ids
                    if self.groups[g].trainable and all(id(p) in subtree for p in self.groups[g].params)
                ]
        return found

    def add_unit(self, module: torch.nn.Module) -> tuple[int, list[int]]:
        """``module`` runs compiled: it is hooked as one unit that needs
        every group its subtree uses (note "compiled units" in
        zcore.engine.compiled_units). Returns its index k and the hooked
        modules it gathers for (itself among them, if it was hooked), which
        are entered no more."""
        inside = {id(m) for m in module.modules()}
        taken = [k for k, hooked in enumerate(self._sites.modules) if id(hooked) in inside]
        groups = dict.fromkeys(self.group_of_param[id(p)] for p in module.parameters())
        for k in taken:
            groups.update(dict.fromkeys(self._sites.groups(self._sites.site(k))))
        k = self._sites.index(module)
        if k is None:
            k = self._sites.add_module(module, list(groups))
        else:
            for g in groups:
                self._sites.add_to_module(k, g)
        self._units.add(k)
        return k, taken

    def remove_from_module(self, k: int, group: int) -> None:
        """Hooked module ``k`` no longer needs ``group`` (unregister_external_parameter)."""
        self._sites.remove_from_module(k, group)

    def set_external_adopter(self, adopter: Callable[[torch.nn.Module, torch.nn.Parameter], None]) -> None:
        """How a use of a parameter by a module that neither owns nor
        declared it is declared (zcore.engine.gathered_parameters.add_external)."""
        self._external_adopter = adopter

    def _adopt_external(self, param: torch.nn.Parameter, module: torch.nn.Module) -> bool:
        if self._external_adopter is None:
            return False
        self._external_adopter(module, param)
        log.info(
            "zcore ZeRO-3: %s uses parameter %s, which it neither owns nor declared; gathering it whenever "
            "it runs, as zcore.register_external_parameter would", self._names.module(module),
            self._names.param(param),
        )
        return not self._released(param)

    def set_master_writer(self, writer: Callable[[ShardedGroup, torch.Tensor], None]) -> None:
        """How a changed shard's values reach the fp32 master (GatheredParameters)."""
        self._master_writer = writer

    def write_back(self, group: int, source_rank: int) -> None:
        """Every data-parallel rank takes ``source_rank``'s full values of a
        gathered group into its shard (and master); the gathered buffer gets
        them too. ``source_rank``: a rank of the world, or with a mesh of
        several parallelisms (zcore.parallel.mesh) a position in this
        rank's "dp" group, whose ranks hold the same slices."""
        self.finish_update()  # the master is written below
        g = self.groups[group]
        full = self.buffers.current(group)
        if self.data_parallel.size > 1:
            comm.broadcast_from(full, source_rank, self.data_parallel.group)
        values = g.shard_of(full)
        self.gathers.drop([group])
        self.write_shard(group, values)
        if self._master_writer is not None and g.trainable:
            self._master_writer(g, values)

    def stats(self) -> GatherStats:
        c = self.coordinator.stats()
        b = self.buffers.stats
        values = {f.name: getattr(c, f.name, None) for f in fields(GatherStats)}
        values.update({f.name: getattr(b, f.name) for f in fields(BufferStats)})
        values["secondary_gathers"] = self.gathers.secondary_gathers
        values["secondary_bytes"] = sum(t.numel() * t.element_size() for t in self.gathers.held())
        return GatherStats(**values)

    def stored_tensors(self) -> list[torch.Tensor]:
        persistent = [
            self.buffers.current(g.index)
            for g in self.groups
            if self.buffers.persistent[g.index] and self.buffers.holds(g.index)
        ]
        return [g.local_shard for g in self.groups if g.in_memory] + persistent + self.gathers.held()

    def reset_peak(self) -> None:
        self.coordinator.reset_peak()
        self.buffers.reset_peak()

    def _released(self, t: torch.Tensor) -> bool:
        group = self.group_of_param.get(id(t))
        return group is not None and not self._plans.gathered(group)

    def _describe_module(self, module: Optional[torch.nn.Module]) -> str:
        """None: the innermost hooked module running."""
        if module is None:
            call = self._calls.running()
            if call is None:
                return "code outside any module"
            module = self._sites.modules[call.index]
        return self._names.module(module)


_TIERS = {Tier.DEVICE: _C.ShardTier.DEVICE, Tier.HOST: _C.ShardTier.HOST, Tier.NVME: _C.ShardTier.NVME}


def nvme_host_bytes(on_nvme: list[ShardedGroup], staging: int) -> int:
    """Host pool for NVMe shard reads: the staging budget, plus room for two
    whole shards read outside the plans (checkpoints), plus each buffer's
    rounding to the I/O alignment."""
    largest = max(g.shard_numel * g.dtype.itemsize for g in on_nvme)
    return staging + 2 * largest + (len(on_nvme) + 2) * PAGE_ALIGNMENT


def staging_bytes(
    groups: list[ShardedGroup], config: _C.CoordinatorConfig, world_size: int, offload: OffloadPolicy
) -> int:
    """Bytes for shards read ahead of their all-gathers. By default twice
    the prefetch bucket's share of this rank (so that reads run ahead of the
    all-gathers), and never less than the largest offloaded shard, so that
    any model trains, whatever its largest layer. A budget the user set
    (offload_param buffer_count x buffer_size) is taken as it is, and
    refused at once if the largest shard does not fit in it."""
    offloaded = [g for g in groups if g.padded_numel >= config.persistence_threshold]
    if not offloaded:
        return 0
    itemsize = max(g.dtype.itemsize for g in offloaded)
    largest = max(offloaded, key=lambda g: g.shard_numel)
    need = largest.shard_numel
    what = f"the largest parameter shard of this rank ({need} elements, group {largest.index})"
    if offload.staging_buffers is not None:
        count, size = offload.staging_buffers
        if count * size < need:
            raise ConfigError(
                f"zero_optimization.offload_param.buffer_count x buffer_size = {count} x {size} "
                f"elements cannot hold {what}: set buffer_size to at least {-(-need // count)}, or "
                "leave both keys out and zcore sizes its staging from the model"
            )
        elements = count * size
    else:
        elements = max(need, 2 * config.prefetch_bucket_elements // world_size)
    return elements * itemsize


def swap_capacity(on_nvme: list[ShardedGroup]) -> int:
    """Swap bytes for the NVMe shards, each extent rounded to the I/O alignment."""
    return sum(-(-g.shard_numel * g.dtype.itemsize // PAGE_ALIGNMENT) * PAGE_ALIGNMENT for g in on_nvme)


def coordinator_config(zero: Any) -> _C.CoordinatorConfig:
    """From the config's zero_optimization section."""
    return _C.CoordinatorConfig(
        prefetch_bucket_elements=zero.stage3_prefetch_bucket_size,
        max_live_elements=zero.stage3_max_live_parameters,
        max_reuse_distance=zero.stage3_max_reuse_distance,
        persistence_threshold=zero.stage3_param_persistence_threshold,
    )
