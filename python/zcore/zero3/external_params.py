"""ZeRO-3: parameters used outside their module (note "external parameters").

A module that uses another module's parameter needs its group gathered
while it runs, which ``zcore.register_external_parameter`` declares. A use
that zcore can see is declared automatically, as DeepSpeed does: a module
whose forward returns a zcore parameter (or a view of one) hands it to the
calling module, the innermost hooked module running (the model itself is
always hooked), whose calls gather it from then on; the current call takes
it over before the returning module lets it go. A use zcore cannot see
ahead (another module's parameter read as an attribute) is caught while the
trace records, at the first operator given the parameter
(zcore.zero3.recording_checks): it is declared then for the module whose
forward runs the operator, and gathered on the spot, as DeepSpeed gathers a
parameter it finds not available on access. Every rank runs the same
forward while recording, so every rank gathers it at the same point.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from zcore.zero3.gather_buffers import GatherBuffers
from zcore.zero3.module_calls import BackwardExit, CallTracker, ModuleCall
from zcore.zero3.plan_execution import PlanExecutor
from zcore.zero3.use_sites import ModelNames, UseSites

log = logging.getLogger("zcore")


class ExternalParameters:
    def __init__(
        self,
        sites: UseSites,
        plans: PlanExecutor,
        calls: CallTracker,
        buffers: GatherBuffers,
        group_of_param: dict[int, int],
        names: ModelNames,
    ) -> None:
        self._sites = sites
        self._plans = plans
        self._calls = calls
        self._buffers = buffers
        self._group_of_param = group_of_param
        self._names = names

    def hand_over(self, returned: list[torch.Tensor], caller: ModuleCall) -> None:
        """``caller`` takes over the parameters among ``returned`` (the
        output of a module it called, which is about to let them go)."""
        for t in returned:
            group = self.group_viewed_by(t)
            if group is None or self._buffers.persistent[group] or any(
                group in self._sites.groups(site) for site in self._calls.running_sites()
            ):
                continue  # not a parameter, or gathered for good, or kept by a running call
            self._sites.add_to_module(caller.index, group)
            self._plans.enter(self._sites.for_groups([group]))  # in use by the returning module: no gather
            caller.site = self._sites.site(caller.index)  # leaves (forward and backward) with it
            if caller.exit is BackwardExit.PARAMETER_GRADIENTS:
                self._calls.await_grads(caller, [group])
            what = (
                f"parameter {self._names.param(t)}" if id(t) in self._group_of_param
                else f"a view of parameters {self._names.params_of(group)}"
            )
            log.info(
                "zcore ZeRO-3: %s got %s from a module it called; gathering them whenever it "
                "runs, as zcore.register_external_parameter would",
                self._sites.name(caller.site), what,
            )

    def declare(self, k: int, group: int, hooked_now: bool) -> None:
        """Hooked module ``k`` needs ``group`` from now on
        (zcore.register_external_parameter). A declaration made inside a
        forward (as GatheredParameters' fwd_module makes it) holds for the
        calls running: a call of ``k`` takes the group over for the rest
        of its forward and for its backward; where ``k`` was ``hooked_now``
        (its running call, if any, began unhooked), the innermost running
        call takes it over for this call, as for a returned parameter."""
        self._sites.add_to_module(k, group)
        running = self._calls.running_calls()
        takers = running[-1:] if hooked_now else [c for c in running if c.index == k]
        for call in takers:
            if group in self._sites.groups(call.site):
                continue
            self._plans.enter(self._sites.for_groups([group]))  # gathered now, left with the call
            call.site = (
                self._sites.site(k) if call.index == k
                else self._sites.for_groups([*self._sites.groups(call.site), group])
            )
            if call.exit is BackwardExit.PARAMETER_GRADIENTS:
                self._calls.await_grads(call, [group])

    def group_viewed_by(self, t: torch.Tensor) -> Optional[int]:
        """The group of a zcore parameter, or of a gathered buffer ``t`` views."""
        group = self._group_of_param.get(id(t))
        if group is None and t.layout == torch.strided:
            owner = self._buffers.owner_of(t)
            group = None if owner is None else owner[0]
        return group
