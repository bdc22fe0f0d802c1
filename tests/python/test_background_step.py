"""The optimizer step behind the next forward (zcore.step.background_step).

At stage 3 with the optimizer states on NVMe and every parameter shard in
host memory, engine.step() returns while a worker streams the sub-groups;
the next forward waits for each unit's update before gathering it.

- BackgroundStep alone: its states, waiting for one unit or all, a failure
  raised on the caller's thread by finish(), then refused until reset.
- Training with sub-group steps slowed down, so that the forward really
  overtakes the update: step() returns before the update is done, and
  losses and final parameters still match single-process torch AdamW at
  worlds 1 and 2 (a gather that read a shard before its update would not).
- A step that fails behind the forward: the forward raises the failure
  once its plan is done, and the engine then refuses to go on and to save
  until a checkpoint load replaces every state.
"""

import math
import threading
import time

import pytest

from distributed import run_ranks
from training import ON_DEMAND, assert_matches, train_reference, train_zcore, zcore_config
from zcore.step.background_step import BackgroundStep, StepState
from zcore.errors import InvalidStateError

STEPS = 6
BATCH = 12
DELAY = 0.02  # seconds added to every sub-group's step


def test_a_unit_is_waited_for_alone_and_the_step_as_a_whole():
    step = BackgroundStep()
    release = threading.Event()

    def work(report):
        report(0)
        release.wait(10)
        report(1)

    step.start(work)
    assert step.state is StepState.RUNNING
    step.wait_unit(0)  # reported before the worker blocks
    with pytest.raises(InvalidStateError, match="cannot start while the last one is running"):
        step.start(work)
    release.set()
    step.wait_unit(1)
    step.finish()
    assert step.state is StepState.IDLE
    step.wait_unit(5)  # nothing runs: at once


def test_a_failure_is_raised_on_the_callers_thread_then_refused_until_reset():
    step = BackgroundStep()

    def work(report):
        report(0)
        raise OSError("disk full")

    step.start(work)
    step.wait_unit(1)  # never reported: returns once the worker has failed, raising nothing
    assert step.failed and step.state is StepState.RUNNING
    with pytest.raises(OSError, match="disk full"):
        step.finish()
    assert step.state is StepState.FAILED
    with pytest.raises(InvalidStateError, match="failed part-way .*disk full"):
        step.finish()
    step.wait_unit(0)  # at once: finish() is what raises
    step.reset()
    assert step.state is StepState.IDLE
    step.start(lambda report: report(0))
    step.finish()


def slow_sub_groups(monkeypatch_target):
    """Every sub-group's step takes DELAY longer."""
    original = monkeypatch_target._step_sub_group

    def slowed(self, *args, **kwargs):
        time.sleep(DELAY)
        return original(self, *args, **kwargs)

    monkeypatch_target._step_sub_group = slowed


# Every group gathered on demand; or the small ones (LayerNorms, biases)
# persistent, which take their update at their next use instead.
LAYOUTS = {"on demand": ON_DEMAND, "persistent small groups": {"stage3_param_persistence_threshold": 2000}}


def config(path: str, layout: str = "on demand") -> dict:
    nvme = {"device": "nvme", "nvme_path": path}
    # Parameters in host memory (max_in_cpu's default), sub-groups smaller than the GPT's units.
    zero = {**LAYOUTS[layout], "offload_param": nvme, "offload_optimizer": nvme, "sub_group_size": 1000}
    return zcore_config(3, 1, 0.0, zero=zero, train_batch_size=BATCH)


def train_slowed(rank, world, path, layout):
    from zcore.step.swapped_optimizer import SwappedAdamUpdate

    slow_sub_groups(SwappedAdamUpdate)
    overtaken = []

    def watch(engine):
        return overtaken

    import zcore.engine.engine

    original_step = zcore.engine.engine.Engine.step

    def step(self):
        original_step(self)
        background = self.optimizer.update.background
        overtaken.append(background is not None and background.state is StepState.RUNNING)

    zcore.engine.engine.Engine.step = step
    return train_zcore(rank, world, "gpt", config(path, layout), STEPS, inspect=watch)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("world", [1, 2])
def test_the_forward_overtakes_a_slow_update_and_training_is_exact(world, layout, tmp_path):
    results = run_ranks(train_slowed, world, str(tmp_path), layout, launcher=world > 1, timeout=600)
    ref = train_reference("gpt", 0.0, STEPS, world, 1, batch=BATCH)
    for rank, got in enumerate(results):
        assert got["update"] == "SwappedAdamUpdate"
        assert all(got["inspected"]), f"rank {rank}: step() waited for the update: {got['inspected']}"
        assert_matches(got, ref, 1e-5, f"{layout}, world {world}, rank {rank}")


def fail_behind(rank, world, path):
    import torch

    import zcore
    from models import make_model
    from zcore.step.swapped_optimizer import SwappedAdamUpdate

    original = SwappedAdamUpdate._step_sub_group
    calls = []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) > len(self.master.sub_groups) + 2:  # in the second step, behind the third forward
            time.sleep(DELAY)
            raise OSError(28, "No space left on device (injected)")
        return original(self, *args, **kwargs)

    SwappedAdamUpdate._step_sub_group = failing
    engine, *_ = zcore.initialize(model=make_model("gpt"), config=config(path))
    x = torch.randint(0, 64, (BATCH, 16))
    outcome = {}
    for step in range(3):
        try:
            loss = engine(x).float().mean()
            engine.backward(loss)
            engine.step()
        except Exception as exc:  # noqa: BLE001 - what the test checks
            outcome["failed at"] = (step, type(exc).__name__, str(exc))
            break
        if step == 0:
            engine.save_checkpoint(path + "/before")
    for name, call in (
        ("forward", lambda: engine(x)),
        ("save", lambda: engine.save_checkpoint(path + "/ckpt")),
    ):
        try:
            call()
            outcome[name] = "ran"
        except InvalidStateError as exc:
            outcome[name] = str(exc)
    SwappedAdamUpdate._step_sub_group = original
    engine.load_checkpoint(path + "/before")  # every state replaced: the engine goes on
    loss = engine(x).float().mean()
    engine.backward(loss)
    engine.step()
    outcome["after load"] = float(loss)
    engine.destroy()
    return outcome


def test_a_step_that_fails_behind_the_forward_breaks_the_engine_until_a_load(tmp_path):
    (outcome,) = run_ranks(fail_behind, 1, str(tmp_path), launcher=False, timeout=300)
    step, kind, message = outcome["failed at"]
    assert step == 2 and kind == "OSError" and "injected" in message, outcome
    for name in ("forward", "save"):
        assert "cannot continue" in outcome[name] and "injected" in outcome[name], (name, outcome)
    assert math.isfinite(outcome["after load"]), outcome
