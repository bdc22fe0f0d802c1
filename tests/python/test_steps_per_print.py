"""steps_per_print: DeepSpeed's progress line (its engine's _report_progress
in 0.19: ``step=N, skipped=K, lr=[...], mom=[...]``), on rank 0 after every
steps_per_print-th optimizer step, skipped steps counted, the learning rate
read after the schedule moved. It prints by default (stderr, ``[zcore] ``
first), and once only, in the user's format, when the user's logging
handles it, also when they set it up after zcore.initialize."""

from __future__ import annotations

import logging
import subprocess
import sys

import torch

import zcore
from distributed import run_ranks
from log_capture import capture_zcore_log
from zcore.engine.observation import StepLog, StepObservation

STEPS_PER_PRINT = 3


def config(**extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.8, 0.95]}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_type": "linear"}},
        "steps_per_print": STEPS_PER_PRINT,
        **extra,
    }


def train_and_log(rank: int, world: int, extra: dict) -> dict:
    messages = capture_zcore_log()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    engine, *_ = zcore.initialize(model=model, config=config(**extra), model_parameters=model.parameters())
    after_step = {}  # what DeepSpeed's _report_progress reads after each step
    for step in range(1, 8):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(4, 8, generator=g).to(torch.float16 if "fp16" in extra else torch.float32)
        loss = (engine(x).float() ** 2).mean() * 1e4  # fp16: large gradients overflow at the start
        engine.backward(loss)
        engine.step()
        groups = engine.optimizer.param_groups
        after_step[engine.global_steps] = (engine.skipped_steps, engine.get_lr(), [g["betas"] for g in groups])
    engine.destroy()
    return {"lines": [m for m in messages.messages if m.startswith("step=")], "after_step": after_step}


def expected_lines(after_step: dict) -> list[str]:
    return [
        f"step={step}, skipped={skipped}, lr={lr}, mom={mom}"
        for step, (skipped, lr, mom) in sorted(after_step.items())
        if step % STEPS_PER_PRINT == 0
    ]


def test_rank_0_logs_deepspeeds_progress_line_every_steps_per_print_steps():
    ranks = run_ranks(train_and_log, 2, {}, timeout=180)
    lines = ranks[0]["lines"]
    after_step = ranks[0]["after_step"]
    assert lines == expected_lines(after_step), lines
    assert [line.split(",")[0] for line in lines] == ["step=3", "step=6"]
    # The lr read after the schedule moved: WarmupLR moves it every step, so
    # a line read before would show the previous step's.
    assert after_step[3][1] != after_step[2][1] and f"lr={after_step[3][1]}," in lines[0]
    assert lines[0].endswith("mom=[(0.8, 0.95)]")
    assert ranks[1]["lines"] == []


def test_skipped_steps_count_toward_the_cadence_and_are_reported():
    (out,) = run_ranks(train_and_log, 1, {"fp16": {"enabled": True, "initial_scale_power": 32}},
                       launcher=False, timeout=180)
    assert out["after_step"][STEPS_PER_PRINT][0] > 0, out  # steps 1-3 overflowed at 2**32
    assert out["lines"] == expected_lines(out["after_step"]), out


SCRIPT = """
import logging, sys, torch, zcore
setup = sys.argv[1]

def train(steps):
    model = torch.nn.Linear(8, 4)
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}
    engine, *_ = zcore.initialize(model=model, config=config, model_parameters=model.parameters())
    for _ in range(steps):
        engine.backward(engine(torch.ones(2, 8)).sum())
        engine.step()
    engine.destroy()

if setup == "configured before":
    logging.basicConfig(level=logging.INFO, format="user %(name)s: %(message)s", stream=sys.stdout)
if setup == "silenced":
    logging.getLogger("zcore.steps").setLevel(logging.WARNING)
train(4)
if setup == "configured after":
    logging.basicConfig(level=logging.INFO, format="user %(name)s: %(message)s", stream=sys.stdout)
    train(2)
"""


def run_script(setup: str) -> tuple[list[str], list[str]]:
    """The progress lines a user's script prints to (stdout, stderr)."""
    done = subprocess.run([sys.executable, "-c", SCRIPT, setup], capture_output=True, text=True, timeout=240,
                          check=False)
    assert done.returncode == 0, done.stderr
    pick = lambda text: [line for line in text.splitlines() if "step=" in line]  # noqa: E731
    return pick(done.stdout), pick(done.stderr)


def test_the_progress_line_prints_by_default_and_once_where_the_user_configured_logging():
    mom = "mom=[(0.9, 0.999)]"
    default = [f"[zcore] step=2, skipped=0, lr=[0.01], {mom}", f"[zcore] step=4, skipped=0, lr=[0.01], {mom}"]
    assert run_script("none") == ([], default)
    user = [f"user zcore.steps: step=2, skipped=0, lr=[0.01], {mom}"]
    assert run_script("configured before") == (user + [user[0].replace("step=2", "step=4")], [])
    # Logging set up after zcore.initialize (the first engine's): the user's handler alone from then on.
    assert run_script("configured after") == (user, default)
    assert run_script("silenced") == ([], [])


def test_the_line_lists_every_group_and_reads_them_only_when_due():
    """DeepSpeed's format: lr and mom one entry per parameter group."""
    read = []

    def lr() -> list:
        read.append("lr")
        return [0.001, 0.002]

    def mom() -> list:
        read.append("mom")
        return [(0.9, 0.999), 0.5]

    messages = capture_zcore_log()
    try:
        for rank in (0, 1):
            observation = StepObservation(None, [], None, StepLog(rank, steps_per_print=2, wall_clock_breakdown=False))
            for step in (1, 2, 3, 4):
                observation.report_progress(step, step // 3, lr, mom)
    finally:
        logging.getLogger("zcore").removeHandler(messages)
    assert messages.messages == [
        "step=2, skipped=0, lr=[0.001, 0.002], mom=[(0.9, 0.999), 0.5]",
        "step=4, skipped=1, lr=[0.001, 0.002], mom=[(0.9, 0.999), 0.5]",
    ]
    assert read == ["lr", "mom"] * 2
