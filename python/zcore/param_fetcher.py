"""ZeRO-3 at run time: executes the native coordinator's plans.

The coordinator (zcore._C.ParamCoordinator, protocol in
cpp/include/zcore/coordinator.h) decides at each module which parameter
groups to gather, wait for and release; ``ParamFetcher`` owns it, the groups
and their buffers, and does what the plans say: one asynchronous all-gather
of a group's shard into a buffer per kGather, parameters pointed at views of
the buffer at kWait, pointed away and the buffer returned at kRelease. The
module hooks (zcore.hooks) call in here; the engine brackets each step.

A step is one forward and its backward (one trace: backward continues it).
Forward with grad enabled uses trace key TRAIN, without grad (evaluation,
generation) key NO_GRAD; a no-grad step ends when its forward returns, a
training step when the engine's backward has run, or at the next forward if
no backward came.

Saved tensors (note "saved views"): autograd saves views of parameters for
backward (``weight.t()`` of a Linear). Such a view aliases the gathered
buffer, which is released after the module and reused for another group, so
the engine's forward runs under saved-tensor hooks: a saved tensor that views
a gathered buffer is kept as (group, offset, size, stride) and rebuilt from
the group's buffer of the moment at backward, when the module's backward
pre-hook has gathered the group again. Arena compaction moves buffers the
same way, which is why nothing else may keep a view across a gather.

Parameters used outside their module (note "external parameters"): a module
that uses another module's parameter needs its group gathered while it
runs, which ``zcore.register_external_parameter`` declares. A use that
zcore can see is declared automatically, as DeepSpeed does: a module whose
forward returns a zcore parameter (or a view of one) hands it to the calling
module, the innermost hooked module running (the model itself is always
hooked), whose calls gather it from then on; the current call takes it over
before the returning module lets it go. A use zcore cannot see (another
module's parameter read as an attribute) is caught while the trace records
(zcore.recording_checks) with an error that names the parameter and the fix.

Activation checkpointing (note "activation checkpointing"):
``torch.utils.checkpoint`` runs a region's forward again inside backward
(recognised by autograd's current graph task). Non-reentrant, it does so
under its own saved-tensor hooks, so the tensors it saves are plain views
of the gathered buffers, not the relocatable views above; reentrant, it
backpropagates the recomputed graph at once. A recomputed module call
therefore gathers its groups and keeps them in use after it returns, until
the backward of a call of the same module is left (the original call's,
or with reentrant checkpointing its own): its buffers cannot be released
or moved while backward may still read what the recomputation saved.
Calls are matched per module, oldest first; groups of a recomputation that
no backward leaves afterwards are released at the end of the step. The
engine's forward turns off checkpoint's early stop, which would end a
recomputation inside a module, before its forward post-hook.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, fields
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch.utils.checkpoint import set_checkpoint_early_stop

from zcore import _C, comm
from zcore.errors import InvalidStateError
from zcore.gather_buffers import BufferStats, GatherBuffers, arena_capacity
from zcore.recording_checks import END_OF_STEP, RankAgreement, ReleasedParameterCheck, signature
from zcore.sharded_group import ShardedGroup

log = logging.getLogger("zcore")

TRAIN, NO_GRAD = 0, 1  # trace keys

_GATHER, _WAIT, _RELEASE = _C.Action.GATHER, _C.Action.WAIT, _C.Action.RELEASE


class ModuleCall:
    """One call of a hooked module: its backward is entered once (by the
    first gradient of its outputs) and left once: by the gradient of its
    inputs or, when its inputs need none, once the gradients of its trained
    parameters are accumulated (or at the end of backward, when some never
    come). A call made during backward is a recomputation (note
    "activation checkpointing")."""

    __slots__ = ("index", "site", "recomputed", "in_backward", "awaiting")

    def __init__(self, index: int, site: int, recomputed: bool) -> None:
        self.index = index  # the fetcher's hooked module
        self.site = site  # coordinator module id (grows when the call takes over a returned parameter)
        self.recomputed = recomputed
        self.in_backward = False
        # Inputs took no gradient: how many of its trained parameters'
        # gradients are still to come. None: left by its inputs' gradient.
        self.awaiting: Optional[int] = None


class _SavedView(NamedTuple):
    group: int
    offset: int
    size: torch.Size
    stride: tuple[int, ...]


@dataclass(frozen=True)
class GatherStats:
    """Coordinator statistics (elements) and gathered-buffer figures (bytes)."""

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
    arena_capacity: int
    arena_fallbacks: int
    compactions: int
    gathered_bytes: int
    persistent_bytes: int
    peak_gathered_bytes: int


class ParamFetcher:
    def __init__(
        self,
        model: torch.nn.Module,
        groups: list[ShardedGroup],
        modules: list[tuple[torch.nn.Module, list[int]]],
        config: _C.CoordinatorConfig,
        world_size: int,
        check_every_module: bool = False,
    ) -> None:
        """``modules``: every module with parameters and the groups it needs;
        ``model`` is hooked too, with no groups of its own if it has no
        parameters, so that a parameter it takes from a child has a
        module to be gathered for (note "external parameters").
        ``check_every_module``: ranks agree on every use, not only on the
        uses no trace foresaw (config stage3_rank_agreement_check)."""
        self.groups = groups
        self.world_size = world_size
        self.coordinator = _C.ParamCoordinator(config)
        for g in groups:
            self.coordinator.register_group(g.padded_numel, g.dtype.itemsize)
        self._module_names = {id(m): name for name, m in model.named_modules()}
        self._param_names = {id(p): name for name, p in model.named_parameters()}
        # sites[k]: the coordinator module of hooked module k (replaced when an
        # external parameter adds a group to it); modules[k]: the module.
        self.sites: list[int] = []
        self.modules: list[torch.nn.Module] = []
        self._module_index: dict[int, int] = {}  # id(module) -> k
        self._site_names: dict[int, str] = {}  # coordinator module -> what it is, for errors
        for module, ids in modules:
            self.add_module(module, ids)
        if self.module_index(model) is None:
            self.add_module(model, [])
        self._site_of_groups: dict[tuple[int, ...], int] = {}
        persistent = [self.coordinator.persistent(g.index) for g in groups]
        capacity = arena_capacity(
            groups, persistent, config.max_live_elements, config.prefetch_bucket_elements
        )
        self.buffers = GatherBuffers(groups, persistent, capacity)
        self.group_of_param = {id(p): g.index for g in groups for p in g.params}
        self._in_flight: dict[int, Optional[Any]] = {}  # group -> its all-gather's Work
        self._forward_stack: list[ModuleCall] = []
        self._backward_open: dict[int, ModuleCall] = {}  # id(call) -> call
        self._master_writer: Optional[Callable[[ShardedGroup], None]] = None
        self._entering: list[int] = []  # groups of the module being entered
        # id(param) -> the calls whose backward waits for its gradient.
        self._awaiting: dict[int, list[ModuleCall]] = {}
        # module index -> its recomputed calls still holding their groups.
        self._recomputed: dict[int, list[ModuleCall]] = {}
        self._agreement = RankAgreement(groups[0].device) if world_size > 1 and groups else None
        self._check_every_module = check_every_module
        self._released_check = ReleasedParameterCheck(
            self._released, self._describe_param, self._describe_module
        )

    # The engine's side: steps.
    def forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        grad = torch.is_grad_enabled()
        if self.coordinator.in_step:
            self.end_step()  # the previous forward had no backward
        self.coordinator.begin_step(TRAIN if grad else NO_GRAD)
        # A key's first step records its trace: check every operator then.
        check = self._released_check if self.coordinator.recording else contextlib.nullcontext()
        try:
            with (
                torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack),
                set_checkpoint_early_stop(False),
                check,
            ):
                out = module(*args, **kwargs)
        except BaseException:
            self.abort()
            raise
        if not grad:
            self.end_step()
        return out

    def end_step(self) -> None:
        """After backward: closes the module calls whose inputs took no
        gradient (their backward post-hook never fires), then ends the step."""
        if not self.coordinator.in_step:
            return
        if self._agreement is not None and (self._check_every_module or self.coordinator.recording):
            try:
                self._agreement.check(END_OF_STEP, lambda: "the end of the step")
            except BaseException:
                self.abort()
                raise
        for call in list(self._backward_open.values()):
            self.exit_backward(call)
        for calls in self._recomputed.values():
            for call in calls:
                self._execute(self.coordinator.after_module(call.site))
        self._recomputed.clear()
        self._awaiting.clear()
        self._execute(self.coordinator.end_step())
        notice = self.coordinator.take_departure_notice()
        if notice is not None:
            log.info(
                "zcore ZeRO-3: step %d (trace %d) left its recorded module order at use %d "
                "(expected group %d, got %d); gathering on demand and recording the new order. "
                "Said once until the order is stable again.",
                notice.step, notice.trace_key, notice.position, notice.expected, notice.actual,
            )

    def abort(self) -> None:
        self._forward_stack.clear()
        self._backward_open.clear()
        self._awaiting.clear()
        self._recomputed.clear()
        self._execute(self.coordinator.abort_step())

    def publish(self) -> None:
        """After an optimizer step: the trained groups that stay gathered
        (persistent ones) get the new values in place, in one all-gather."""
        self._refresh([g for g in self.groups if g.trainable])

    def reload(self) -> None:
        """After a checkpoint load replaced the shards: every group that
        stays gathered, trained or frozen, gets the new values."""
        self._refresh(self.groups)

    def _refresh(self, groups: list[ShardedGroup]) -> None:
        stale = [g for g in groups if self.buffers.persistent[g.index] and self.buffers.holds(g.index)]
        if not stale:
            return
        if self.world_size == 1:
            for g in stale:
                self.buffers.current(g.index).copy_(g.local_shard)
            return
        # Frozen and trained groups may differ in dtype: one all-gather per dtype.
        for dtype in dict.fromkeys(g.dtype for g in stale):
            self._all_gather_into_place([g for g in stale if g.dtype == dtype])

    def _all_gather_into_place(self, stale: list[ShardedGroup]) -> None:
        send = torch.cat([g.local_shard for g in stale])
        recv = torch.empty(self.world_size * send.numel(), dtype=send.dtype, device=send.device)
        comm.all_gather_into(recv, send)
        recv = recv.view(self.world_size, -1)
        start = 0
        for g in stale:
            full = self.buffers.current(g.index).view(self.world_size, g.shard_numel)
            full.copy_(recv[:, start : start + g.shard_numel])
            start += g.shard_numel

    # The hooks' side: module calls.
    def enter_forward(self, module: int) -> ModuleCall:
        recomputed = self.coordinator.in_step and torch._C._current_graph_task_id() != -1
        call = ModuleCall(module, self.sites[module], recomputed)
        self._enter(call.site)
        self._forward_stack.append(call)
        return call

    def exit_forward(self, returned: list[torch.Tensor]) -> ModuleCall:
        """``returned``: the tensors in the module's output."""
        call = self._forward_stack.pop()
        if call.recomputed:  # note "activation checkpointing"
            self._recomputed.setdefault(call.index, []).append(call)
            return call
        if self._forward_stack:
            self._hand_over(returned, self._forward_stack[-1])
        self._execute(self.coordinator.after_module(call.site))
        return call

    def enter_backward(self, call: ModuleCall) -> None:
        if call.in_backward:
            return
        call.in_backward = True
        self._backward_open[id(call)] = call
        self._enter(call.site)

    def exit_backward(self, call: ModuleCall) -> None:
        if self._backward_open.pop(id(call), None) is None:
            return
        call.in_backward = False
        self._execute(self.coordinator.after_module(call.site))
        held = self._recomputed.get(call.index)
        if held:
            self._execute(self.coordinator.after_module(held.pop(0).site))

    def exit_backward_after_grads(self, call: ModuleCall) -> None:
        """``call``'s inputs need no gradient, so nothing marks the end of
        its backward but the gradients of its trained parameters: all of
        its backward nodes lead to them (note "backward without input
        gradients" in zcore.hooks)."""
        call.awaiting = 0
        self._await_grads(call, self.coordinator.module_groups(call.site))

    def grad_accumulated(self, param: torch.Tensor) -> None:
        """Autograd accumulates a parameter's gradient once per backward,
        after every use's contribution: no call waiting for it needs it more."""
        for call in self._awaiting.pop(id(param), ()):
            call.awaiting -= 1
            if call.awaiting == 0:
                self.exit_backward(call)

    # Saved tensors (note "saved views").
    def pack(self, t: torch.Tensor) -> Any:
        if t.layout != torch.strided or id(t) in self.group_of_param:
            return t  # a parameter saved as itself: its .data follows the gathers
        owner = self.buffers.owner_of(t)
        if owner is None:
            return t
        return _SavedView(owner[0], owner[1], t.shape, t.stride())

    def unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _SavedView):
            return saved
        if not self.buffers.holds(saved.group) or saved.group in self._in_flight:
            raise InvalidStateError(
                f"backward needs parameter group {saved.group} (parameters "
                f"{self._describe(saved.group)}) but it is not gathered: a module used a "
                "parameter it does not own; declare it with "
                "zcore.register_external_parameter(module, param)",
                group=saved.group,
            )
        full = self.buffers.current(saved.group)
        # as_strided's offset counts from the start of the storage, not of ``full``.
        return full.as_strided(saved.size, saved.stride, full.storage_offset() + saved.offset)

    # Use sites outside the module hooks (GatheredParameters).
    def site_for(self, group_ids: list[int]) -> int:
        key = tuple(sorted(set(group_ids)))
        if key not in self._site_of_groups:
            self._site_of_groups[key] = self._register(list(key), f"a use of groups {list(key)}")
        return self._site_of_groups[key]

    def gather_site(self, site: int) -> None:
        self._enter(site)

    def release_site(self, site: int) -> None:
        self._execute(self.coordinator.after_module(site))

    def module_index(self, module: torch.nn.Module) -> Optional[int]:
        return self._module_index.get(id(module))

    def add_module(self, module: torch.nn.Module, group_ids: list[int]) -> int:
        """A module to hook, needing ``group_ids``; returns its index k."""
        self._module_index[id(module)] = len(self.sites)
        self.modules.append(module)
        self.sites.append(self._register(group_ids, self._describe_module(module)))
        return len(self.sites) - 1

    def add_to_module(self, module: int, group: int) -> None:
        """Hooked module ``module`` also needs ``group`` from now on."""
        groups = list(self.coordinator.module_groups(self.sites[module]))
        if group not in groups:
            self.sites[module] = self._register(groups + [group], self._site_names[self.sites[module]])

    def set_master_writer(self, writer: Callable[[ShardedGroup], None]) -> None:
        """How a changed local shard reaches the fp32 master (GatheredParameters)."""
        self._master_writer = writer

    def write_back(self, group: int, source_rank: int) -> None:
        """Every rank takes ``source_rank``'s full values of a gathered group
        into its shard (and master); the gathered buffer gets them too."""
        g = self.groups[group]
        full = self.buffers.current(group)
        if self.world_size > 1:
            torch.distributed.broadcast(full, src=source_rank)
        g.local_shard.copy_(g.shard_of(full))
        if self._master_writer is not None and g.trainable:
            self._master_writer(g)

    def stats(self) -> GatherStats:
        c = self.coordinator.stats()
        b = self.buffers.stats
        values = {f.name: getattr(c, f.name, None) for f in fields(GatherStats)}
        values.update({f.name: getattr(b, f.name) for f in fields(BufferStats)})
        return GatherStats(**values)

    def stored_tensors(self) -> list[torch.Tensor]:
        persistent = [
            self.buffers.current(g.index)
            for g in self.groups
            if self.buffers.persistent[g.index] and self.buffers.holds(g.index)
        ]
        return [g.local_shard for g in self.groups] + persistent

    def reset_peak(self) -> None:
        self.coordinator.reset_peak()
        self.buffers.reset_peak()

    # Parameters handed from module to module (note "external parameters").
    def _hand_over(self, returned: list[torch.Tensor], caller: ModuleCall) -> None:
        for t in returned:
            group = self._group_viewed_by(t)
            if group is None or self.buffers.persistent[group] or any(
                group in self.coordinator.module_groups(c.site) for c in self._forward_stack
            ):
                continue  # not a parameter, or gathered for good, or kept by a running call
            self.add_to_module(caller.index, group)
            self._enter(self.site_for([group]))  # in use by the returning module: no gather
            caller.site = self.sites[caller.index]  # leaves (forward and backward) with it
            if caller.awaiting is not None:
                self._await_grads(caller, [group])
            what = (
                f"parameter {self._describe_param(t)}" if id(t) in self.group_of_param
                else f"a view of parameters {self._param_list(group)}"
            )
            log.info(
                "zcore ZeRO-3: %s got %s from a module it called; gathering them whenever it "
                "runs, as zcore.register_external_parameter would",
                self._site_names[caller.site], what,
            )

    def _group_viewed_by(self, t: torch.Tensor) -> Optional[int]:
        """The group of a zcore parameter, or of a gathered buffer ``t`` views."""
        group = self.group_of_param.get(id(t))
        if group is None and t.layout == torch.strided:
            owner = self.buffers.owner_of(t)
            group = None if owner is None else owner[0]
        return group

    def _await_grads(self, call: ModuleCall, groups: list[int]) -> None:
        for g in groups:
            if self.groups[g].trainable:
                for p in self.groups[g].params:
                    self._awaiting.setdefault(id(p), []).append(call)
                    call.awaiting += 1

    # Plans.
    def _register(self, group_ids: list[int], name: str) -> int:
        site = self.coordinator.register_module(group_ids)
        self._site_names[site] = name
        return site

    def _enter(self, site: int) -> None:
        if self._agreement is not None and (self._check_every_module or self.coordinator.unforeseen(site)):
            # Before any gather: ranks that disagree here would hang in it.
            groups = self.coordinator.module_groups(site)
            self._agreement.check(
                signature(groups), lambda: f"{self._site_names[site]} (groups {list(groups)})"
            )
        self._entering = self.coordinator.module_groups(site)
        try:
            self._execute(self.coordinator.before_module(site))
        finally:
            self._entering = []

    def _execute(self, plan: list) -> None:
        for action, group in plan:
            if action is _GATHER:
                self._start_gather(group)
            elif action is _WAIT:
                self._finish_gather(group)
            else:
                self._release(group)

    def _start_gather(self, group: int) -> None:
        compacts = self.buffers.would_compact(group)
        allow = compacts and self._compaction_is_safe()
        if allow:
            # Compaction moves blocks: no all-gather may still be writing.
            for work in self._in_flight.values():
                if work is not None:
                    work.wait()
            self._in_flight = dict.fromkeys(self._in_flight)
        buf, moved = self.buffers.take(group, allow_compaction=allow)
        if moved:
            for other in self.buffers.in_arena():
                if other != group and other not in self._in_flight:
                    self.groups[other].point_params_at(self.buffers.current(other))
        shard = self.groups[group].local_shard
        if self.world_size == 1:
            buf.copy_(shard)
            self._in_flight[group] = None
        else:
            self._in_flight[group] = comm.all_gather_into(buf, shard, async_op=True)

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
        work = self._in_flight.pop(group)
        if work is not None:
            work.wait()
        self.groups[group].point_params_at(self.buffers.current(group))

    def _release(self, group: int) -> None:
        self.groups[group].release_params()
        self.buffers.give_back(group)

    def _describe(self, group: int) -> str:
        return ", ".join(str(tuple(s)) for s in self.groups[group].shapes)

    def _released(self, t: torch.Tensor) -> bool:
        group = self.group_of_param.get(id(t))
        return group is not None and (not self.buffers.holds(group) or group in self._in_flight)

    def _describe_param(self, param: torch.Tensor) -> str:
        g = self.groups[self.group_of_param[id(param)]]
        shape = next(s for p, s in zip(g.params, g.shapes) if p is param)
        return f"'{self._param_names.get(id(param), '?')}' (shape {tuple(shape)})"

    def _param_list(self, group: int) -> str:
        return ", ".join(f"'{self._param_names.get(id(p), '?')}'" for p in self.groups[group].params)

    def _describe_module(self, module: Optional[torch.nn.Module]) -> str:
        """None: the innermost hooked module running."""
        if module is None:
            if not self._forward_stack:
                return "code outside any module"
            module = self.modules[self._forward_stack[-1].index]
        name = self._module_names.get(id(module))
        if name is None:
            return f"a {type(module).__name__} outside the model"
        return f"module '{name}' ({type(module).__name__})" if name else f"the model ({type(module).__name__})"


def coordinator_config(zero: Any) -> _C.CoordinatorConfig:
    """From the config's zero_optimization section."""
    return _C.CoordinatorConfig(
        prefetch_bucket_elements=zero.stage3_prefetch_bucket_size,
        max_live_elements=zero.stage3_max_live_parameters,
        max_reuse_distance=zero.stage3_max_reuse_distance,
        persistence_threshold=zero.stage3_param_persistence_threshold,
    )
