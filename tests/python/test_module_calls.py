"""zcore.zero3.module_calls: the life of one module call as a state machine, and
the plan executor's refusal of an action it does not know."""

from __future__ import annotations

import pytest

from zcore.errors import InvalidStateError
from zcore.zero3.module_calls import CallState, ModuleCall
from zcore.zero3.plan_execution import PlanExecutor


def test_a_call_goes_forward_backward_and_again_with_a_retained_graph() -> None:
    call = ModuleCall(index=0, site=3, recomputed=False)
    assert call.state is CallState.FORWARD
    assert call.returned() is False
    assert call.state is CallState.RETURNED
    assert call.entered_backward() is True
    assert call.entered_backward() is False  # a second gradient of its outputs
    assert call.left_backward() is True
    assert call.left_backward() is False  # its inputs' gradient after a parameter-gradient exit
    assert call.state is CallState.LEFT
    assert call.entered_backward() is True  # backward over a retained graph


def test_a_recomputation_says_so_when_it_returns() -> None:
    call = ModuleCall(index=0, site=3, recomputed=True)
    assert call.state is CallState.RECOMPUTING
    assert call.returned() is True
    assert call.entered_backward() is True  # reentrant checkpointing backpropagates it


@pytest.mark.parametrize("recomputed", [False, True])
def test_backward_cannot_enter_a_call_still_running_forward(recomputed: bool) -> None:
    call = ModuleCall(index=0, site=3, recomputed=recomputed)
    with pytest.raises(InvalidStateError, match="backward entered a module call running its forward"):
        call.entered_backward()
    assert call.left_backward() is False


def test_a_call_returns_once() -> None:
    call = ModuleCall(index=0, site=3, recomputed=False)
    call.returned()
    with pytest.raises(InvalidStateError, match="returned from forward while its forward returned"):
        call.returned()


def test_an_unknown_plan_action_is_an_error_not_a_release() -> None:
    executor = PlanExecutor.__new__(PlanExecutor)
    executor._actions = {}
    with pytest.raises(InvalidStateError, match="an action this package does not know"):
        executor.execute([("FETCH_SOMETHING", 4)])
