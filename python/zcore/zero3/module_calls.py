"""ZeRO-3: the calls of hooked modules, from forward entry to backward exit.

A call's groups are in use while it runs forward and again while it is in
backward. Its backward is entered once, by the first gradient of its
outputs, and left once: by the gradient of its inputs or, when its inputs
need none (note "backward without input gradients" in zcore.engine.hooks), once
the gradients of its trained parameters are accumulated, or at the end of
backward when some never come.

Activation checkpointing (note "activation checkpointing"):
``torch.utils.checkpoint`` runs a region's forward again inside backward
(recognised by autograd's current graph task). Non-reentrant, it does so
under its own saved-tensor hooks, so the tensors it saves are plain views
of the gathered buffers, not relocatable saved views; reentrant, it
backpropagates the recomputed graph at once. A recomputed module call
therefore keeps its groups in use after it returns, until the backward of a
call of the same module is left (the original call's, or with reentrant
checkpointing its own): its buffers cannot be released or moved while
backward may still read what the recomputation saved. Holds are matched to
backward exits per module, oldest first; those that no backward leaves
afterwards are let go at the end of the step.
"""

from __future__ import annotations

from enum import Enum
from typing import Callable, Optional

import torch

from zcore.errors import InvalidStateError
from zcore.zero3.plan_execution import PlanExecutor
from zcore.zero3.sharded_group import ShardedGroup


class CallState(Enum):
    FORWARD = "running its forward"
    RECOMPUTING = "running its forward again inside backward (activation checkpointing)"
    RETURNED = "its forward returned; backward not entered"
    BACKWARD = "in its backward, groups in use"
    LEFT = "its backward was left (a retained graph may enter it again)"


class BackwardExit(Enum):
    INPUT_GRADIENTS = "left when the gradients of its inputs are computed"
    PARAMETER_GRADIENTS = "its inputs take no gradient: left once its trained parameters' gradients are accumulated"


class ModuleCall:
    """One call of hooked module ``index``, using coordinator module ``site``."""

    __slots__ = ("index", "site", "state", "exit", "grads_to_come", "recomputed")

    def __init__(self, index: int, site: int, recomputed: bool) -> None:
        self.index = index
        self.site = site  # grows when the call takes over a returned parameter
        self.recomputed = recomputed  # a forward run again inside backward
        self.state = CallState.RECOMPUTING if recomputed else CallState.FORWARD
        self.exit = BackwardExit.INPUT_GRADIENTS
        self.grads_to_come = 0  # PARAMETER_GRADIENTS: trained parameters' gradients still to come

    def returned(self) -> bool:
        """Its forward returned; True when it was a recomputation."""
        if self.state not in (CallState.FORWARD, CallState.RECOMPUTING):
            raise InvalidStateError(f"a module call returned from forward while {self.state.value}")
        recomputed = self.state is CallState.RECOMPUTING
        self.state = CallState.RETURNED
        return recomputed

    def entered_backward(self) -> bool:
        """Its backward was entered; False when it already was."""
        if self.state is CallState.BACKWARD:
            return False
        if self.state not in (CallState.RETURNED, CallState.LEFT):
            raise InvalidStateError(f"backward entered a module call {self.state.value}")
        self.state = CallState.BACKWARD
        return True

    def left_backward(self) -> bool:
        """Its backward was left; False when it was not in backward."""
        if self.state is not CallState.BACKWARD:
            return False
        self.state = CallState.LEFT
        return True


class CallTracker:
    """The calls running forward (a stack), in backward, waiting for their
    parameters' gradients, and the recomputations holding their groups."""

    def __init__(
        self, plans: PlanExecutor, groups: list[ShardedGroup], on_left: Callable[[ModuleCall], None]
    ) -> None:
        """``on_left(call)``: after ``call`` leaves its backward."""
        self._plans = plans
        self._groups = groups
        self._on_left = on_left
        self._running: list[ModuleCall] = []
        self._in_backward: dict[int, ModuleCall] = {}  # id(call) -> call
        self._awaiting: dict[int, list[ModuleCall]] = {}  # id(param) -> calls waiting for its gradient
        self._holds: dict[int, list[ModuleCall]] = {}  # module index -> recomputations holding their groups

    def running(self) -> Optional[ModuleCall]:
        """The innermost call running forward."""
        return self._running[-1] if self._running else None

    def running_calls(self) -> list[ModuleCall]:
        """The calls running forward, outermost first."""
        return list(self._running)

    def running_sites(self) -> list[int]:
        return [c.site for c in self._running]

    def enter_forward(self, index: int, site: int) -> ModuleCall:
        recomputed = self._plans.coordinator.in_step and torch._C._current_graph_task_id() != -1
        call = ModuleCall(index, site, recomputed)
        self._plans.enter(call.site)
        self._running.append(call)
        return call

    def exit_forward(self, hand_over: Callable[[ModuleCall], None]) -> ModuleCall:
        """``hand_over(caller)`` runs before the call lets its groups go,
        when a call is running around it."""
        call = self._running.pop()
        if call.returned():  # a recomputation keeps its groups in use
            self._holds.setdefault(call.index, []).append(call)
            return call
        if self._running:
            hand_over(self._running[-1])
        self._plans.leave(call.site)
        return call

    def enter_backward(self, call: ModuleCall) -> None:
        if call.entered_backward():
            self._in_backward[id(call)] = call
            self._plans.enter(call.site)

    def exit_backward(self, call: ModuleCall) -> None:
        if not call.left_backward():
            return
        del self._in_backward[id(call)]
        self._plans.leave(call.site)
        held = self._holds.get(call.index)
        if held:
            self._plans.leave(held.pop(0).site)
        self._on_left(call)

    def exit_backward_after_grads(self, call: ModuleCall) -> None:
        call.exit = BackwardExit.PARAMETER_GRADIENTS
        self.await_grads(call, self._plans.coordinator.module_groups(call.site))

    def await_grads(self, call: ModuleCall, groups: list[int]) -> None:
        """``call`` (leaving by its parameters' gradients) also waits for those of ``groups``."""
        for g in groups:
            if self._groups[g].trainable:
                for p in self._groups[g].params:
                    self._awaiting.setdefault(id(p), []).append(call)
                    call.grads_to_come += 1

    def grad_accumulated(self, param: torch.Tensor) -> None:
        for call in self._awaiting.pop(id(param), ()):
            call.grads_to_come -= 1
            if call.grads_to_come == 0:
                self.exit_backward(call)

    def end_step(self) -> None:
        """Closes the calls still in backward and lets every hold go."""
        for call in list(self._in_backward.values()):
            self.exit_backward(call)
        for calls in self._holds.values():
            for call in calls:
                self._plans.leave(call.site)
        self._holds.clear()
        self._awaiting.clear()

    def abort(self) -> None:
        """Forgets every call: the coordinator's abort lets their groups go."""
        self._running.clear()
        self._in_backward.clear()
        self._awaiting.clear()
        self._holds.clear()
