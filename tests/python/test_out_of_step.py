"""A rank whose engine call raised and that goes on anyway (the script
catches the error) makes every rank raise within seconds, naming that
rank and what it was doing, instead of leaving them all waiting until the
process group's timeout (zcore.engine.rank_calls, note "ranks out of
step"). Ranks whose calls all raised alike go on; so does a rank that
runs forwards without gradients alone at stages 0-2."""

from __future__ import annotations

import re
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zcore
from distributed import run_ranks
from zcore.engine.rank_calls import FAILED, OUT_OF_STEP, WAITING, Failure, Position, Report, judge_unsettled, judge_wait

TIMEOUT = 120  # the harness kills the ranks and fails past this
FAILING_RANK, FAILING_STEP, STEPS = 1, 2, 5
WITHIN = 20.0  # seconds from the failure to the last rank's error (the waits ask once a second)


class BadBatch(Exception):
    """What the script catches."""


class FailsWhenAsked(nn.Module):
    """Three layers; ``fail_now`` makes the next forward raise before the
    first of them runs (at stage 3, before its first gather)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)
        self.fail_now = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail_now:
            self.fail_now = False
            raise BadBatch("bad batch")
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def engine_for(world: int, stage: int, **check) -> tuple[zcore.Engine, FailsWhenAsked]:
    torch.manual_seed(0)
    model = FailsWhenAsked()
    config = {
        "train_batch_size": 4 * world,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        # Gathered on demand: at stage 3 the others wait in the forward's gathers.
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                              "stage3_prefetch_bucket_size": 0},
        **({"out_of_step_check": check} if check else {}),
    }
    engine, *_ = zcore.initialize(model=model, config=config)
    return engine, model


def keep_the_store_until_all_are_done(rank: int, world: int) -> None:
    """Rank 0 holds the process group's store (no torchrun agent here):
    it stays until every other rank is done with it."""
    store = dist.distributed_c10d._get_default_store()
    store.add("test-out-of-step-done", 1)
    deadline = time.monotonic() + 60
    while rank == 0 and store.add("test-out-of-step-done", 0) < world and time.monotonic() < deadline:
        time.sleep(0.05)


def goes_on_after_its_error(rank: int, world: int, stage: int, then: str) -> dict:
    """Trains; on rank 1 the forward of step 2 raises, the script catches it
    and makes ``then`` its next call (backward of the step before's loss,
    step, or the next step's forward). Returns each rank's out-of-step
    error: the call it came from, its message and when."""
    engine, model = engine_for(world, stage)
    x = torch.randn(4, 16)
    out = {"failed_at": None, "error": None}
    loss = None

    def call(name: str, fn):
        try:
            return fn()
        except zcore.InvalidStateError as exc:
            out["error"] = (name, str(exc), time.time())
            raise

    try:
        for step in range(STEPS):
            model.fail_now = rank == FAILING_RANK and step == FAILING_STEP
            try:
                loss = call("forward", lambda: engine(x).square().mean())
            except BadBatch:
                out["failed_at"] = time.time()
                if then == "forward":
                    continue
                if then == "backward":
                    call("backward", lambda: engine.backward(loss))
                call("step", engine.step)
                continue
            call("backward", lambda: engine.backward(loss))
            call("step", engine.step)
    except zcore.InvalidStateError:
        pass
    keep_the_store_until_all_are_done(rank, world)
    return out


@pytest.mark.parametrize("then", ["backward", "step", "forward"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_that_goes_on_after_its_error_stops_every_rank(world: int, stage: int, then: str) -> None:
    results = run_ranks(goes_on_after_its_error, world, stage, then, timeout=TIMEOUT)
    failed_at = results[FAILING_RANK]["failed_at"]
    assert failed_at is not None
    culprit = f"rank {FAILING_RANK}'s forward of micro-step {FAILING_STEP}"
    for rank, got in enumerate(results):
        assert got["error"] is not None, f"rank {rank} trained on"
        call, message, at = got["error"]
        assert "ranks out of step" in message and "same engine calls" in message, message
        assert culprit in message and "raised BadBatch (bad batch)" in message, message
        assert at - failed_at < WITHIN, f"rank {rank} raised {at - failed_at:.1f} s after the failure"
        if rank == FAILING_RANK:
            assert call == then, (call, message)  # its very next call
            assert any(re.search(rf"\brank {r}\b", message) for r in range(world) if r != rank), message  # a peer
        else:
            # Where it waited: in the forward's gathers (stage 3) or the backward's reduction.
            assert f"rank {rank} waited" in message and "collective" in message, message
            assert call in ("forward", "backward"), (call, message)


def every_rank_fails_alike(rank: int, world: int, stage: int) -> dict:
    """Every rank's forward of step 2 raises; each catches it and goes on."""
    engine, model = engine_for(world, stage)
    x = torch.randn(4, 16)
    for step in range(STEPS):
        model.fail_now = step == FAILING_STEP
        try:
            loss = engine(x).square().mean()
        except BadBatch:
            continue
        engine.backward(loss)
        engine.step()
    with zcore.GatheredParameters(list(model.parameters())):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"steps": engine.global_steps, "params": params}


@pytest.mark.parametrize("stage", [2, 3])
def test_ranks_whose_calls_all_raise_alike_go_on(stage: int) -> None:
    results = run_ranks(every_rank_fails_alike, 2, stage, timeout=TIMEOUT)
    assert [r["steps"] for r in results] == [STEPS - 1] * 2
    for name, value in results[0]["params"].items():
        assert torch.equal(value, results[1]["params"][name]), name


def evaluates_alone(rank: int, world: int) -> int:
    """Stage 2: rank 0 runs forwards without gradients between steps, one
    of which raises; they start no collective, so the ranks stay in step."""
    engine, model = engine_for(world, 2)
    x = torch.randn(4, 16)
    for step in range(STEPS):
        if rank == 0:
            with torch.no_grad():
                engine(x)
                model.fail_now = step == FAILING_STEP
                try:
                    engine(x)
                except BadBatch:
                    pass
        engine.backward(engine(x).square().mean())
        engine.step()
    return engine.global_steps


def test_forwards_without_gradients_on_one_rank_are_not_calls_of_the_ranks() -> None:
    assert run_ranks(evaluates_alone, 2, timeout=TIMEOUT) == [STEPS, STEPS]


def unchecked(rank: int, world: int) -> tuple[bool, bool]:
    engine, _ = engine_for(world, 2, enabled=False, patience_seconds=5)
    engine.backward(engine(torch.randn(4, 16)).square().mean())
    engine.step()
    return engine.calls.out_of_step is None, engine.calls.checks


def test_the_check_can_be_turned_off() -> None:
    assert run_ranks(unchecked, 2, timeout=TIMEOUT) == [(True, False)] * 2


# The rules, on reports as the store would hold them.
def at(call: int, phase: str = "forward") -> Position:
    return Position(call, phase, micro_step=call // 3)


MINE = Failure(at(6), started=1, what="BadBatch (bad batch)")


def report(state: str, where: Position, index: int = 0, failed: Failure | None = None) -> Report:
    return Report(state, where, index, f"{state} at {where}", failed)


def test_a_rank_whose_call_raised_goes_on_only_once_every_peer_raised_alike() -> None:
    alike = report(FAILED, at(6), failed=Failure(at(6), 1, "BadBatch (bad batch)"))
    assert judge_unsettled(1, MINE, {0: alike, 2: alike}) == (True, None)
    # A peer not heard from, or behind (waiting at an earlier call): not known yet.
    assert judge_unsettled(1, MINE, {0: alike, 2: None}) == (False, None)
    assert judge_unsettled(1, MINE, {0: report(WAITING, at(5, "step"), index=2)}) == (False, None)
    # Waiting in this call for a collective this rank had started: maybe for a third, slow rank.
    assert judge_unsettled(1, MINE, {0: report(WAITING, at(6), index=1)}) == (False, None)
    # Out of step: waiting for one it never started, past the call, raised elsewhere in it.
    for peer in (
        report(WAITING, at(6), index=2),
        report(WAITING, at(7, "backward"), index=1),
        report(FAILED, at(6), failed=Failure(at(6), 3, "BadBatch (bad batch)")),
        report(OUT_OF_STEP, at(7, "backward")),
    ):
        settled, why = judge_unsettled(1, MINE, {0: peer})
        assert not settled and why is not None and "rank 0" in why, peer


def test_a_waiting_rank_stops_only_where_a_peer_will_never_join() -> None:
    failed = report(FAILED, at(6), failed=MINE)
    # The peer's call raised before it started collective 2 of that call, or at an earlier call.
    assert "rank 1's forward" in judge_wait(0, at(6), 2, None, {1: failed})
    assert "went on past" in judge_wait(0, at(7, "backward"), 1, None, {1: failed})
    # It had started collective 1: the one missing may be a slow third rank.
    assert judge_wait(0, at(6), 1, None, {1: failed, 2: None}) is None
    # A failure every rank had alike, long settled, or a peer that is only waiting too.
    assert judge_wait(0, at(9), 1, at(6), {1: failed}) is None
    assert judge_wait(0, at(9), 1, None, {1: report(WAITING, at(9), index=1)}) is None


def dropped(rank: int, world: int) -> list[bool]:
    import gc
    import weakref

    collected = []
    for stage in (0, 3):
        engine, _ = engine_for(world, stage)
        engine.backward(engine(torch.randn(4, 16)).square().mean())
        engine.step()
        gone = weakref.ref(engine)
        del engine
        gc.collect()
        collected.append(gone() is None)
    return collected


def test_an_engine_of_several_ranks_dropped_without_destroy_is_still_collected() -> None:
    """The waits hold the check weakly, and the check the engine."""
    assert run_ranks(dropped, 2, timeout=TIMEOUT) == [[True, True]] * 2
