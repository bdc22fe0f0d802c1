"""Writes lr_schedule_reference.json beside this file: the learning rates and
momenta that DeepSpeed 0.19.8's own OneCycle and LRRangeTest set, step by
step, for the cases below, and the keyword arguments (the config's params)
the two classes take, with their defaults. tests/python/test_lr_schedules.py
checks zcore's schedules and config sections against them.

Not part of the test suite: it needs DeepSpeed, which zcore does not
install. Run it in a virtual environment of its own:

    python3 -m venv /tmp/venv-ds-lr
    /tmp/venv-ds-lr/bin/pip install torch==2.13.0
    DS_BUILD_OPS=0 /tmp/venv-ds-lr/bin/pip install deepspeed==0.19.8
    DS_ACCELERATOR=cpu /tmp/venv-ds-lr/bin/python tests/python/data/make_lr_schedule_reference.py

Each case builds a torch optimizer (Adam, whose groups hold betas, or SGD
with momentum, whose groups do not) over ``groups`` parameter groups, then
DeepSpeed's schedule with the case's params exactly as DeepSpeed's engine
does (``schedule(optimizer, **params)``), and records the optimizer's
groups after construction and after each ``step()``: with no argument
``steps`` times, or with each of the listed batch iterations.
"""

from __future__ import annotations

import inspect
import json
import os
import pathlib

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
from deepspeed.runtime import lr_schedules  # noqa: E402

OUTPUT = pathlib.Path(__file__).resolve().parent / "lr_schedule_reference.json"

CASES = [
    # OneCycle.
    {"name": "one_cycle_continuous", "type": "OneCycle", "optimizer": "adam", "steps": 30,
     "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 10}},
    {"name": "one_cycle_second_step_size", "type": "OneCycle", "optimizer": "adam", "steps": 26,
     "params": {"cycle_min_lr": 0.003, "cycle_max_lr": 0.07, "cycle_first_step_size": 7,
                "cycle_second_step_size": 13, "cycle_min_mom": 0.85, "cycle_max_mom": 0.95}},
    {"name": "one_cycle_staircase", "type": "OneCycle", "optimizer": "adam", "steps": 34,
     "params": {"cycle_min_lr": 0.001, "cycle_max_lr": 0.1, "cycle_first_step_size": 12,
                "cycle_second_step_size": 18, "cycle_first_stair_count": 4, "cycle_second_stair_count": 3}},
    {"name": "one_cycle_staircase_uneven", "type": "OneCycle", "optimizer": "adam", "steps": 24,
     "params": {"cycle_min_lr": 0.001, "cycle_max_lr": 0.1, "cycle_first_step_size": 7,
                "cycle_second_step_size": 11, "cycle_first_stair_count": 3}},
    {"name": "one_cycle_negative_stairs", "type": "OneCycle", "optimizer": "adam", "steps": 12,
     "params": {"cycle_min_lr": 0.001, "cycle_max_lr": 0.1, "cycle_first_step_size": 5,
                "cycle_first_stair_count": -1, "cycle_second_stair_count": -1}},
    {"name": "one_cycle_decay", "type": "OneCycle", "optimizer": "adam", "steps": 45,
     "params": {"cycle_min_lr": 0.002, "cycle_max_lr": 0.02, "cycle_first_step_size": 8,
                "cycle_second_step_size": 12, "decay_step_size": 3, "decay_lr_rate": 0.5,
                "decay_mom_rate": 0.002}},
    {"name": "one_cycle_decay_lr_only", "type": "OneCycle", "optimizer": "adam", "steps": 30,
     "params": {"cycle_min_lr": 0.002, "cycle_max_lr": 0.02, "cycle_first_step_size": 5,
                "decay_step_size": 4, "decay_lr_rate": 0.25}},
    {"name": "one_cycle_no_decay_step", "type": "OneCycle", "optimizer": "adam", "steps": 30,
     "params": {"cycle_min_lr": 0.002, "cycle_max_lr": 0.02, "cycle_first_step_size": 5,
                "decay_lr_rate": 0.25, "decay_mom_rate": 0.01}},
    {"name": "one_cycle_no_second_half", "type": "OneCycle", "optimizer": "adam", "steps": 14,
     "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.05, "cycle_first_step_size": 6,
                "cycle_second_step_size": 0, "cycle_first_stair_count": 2}},
    {"name": "one_cycle_momentum_off", "type": "OneCycle", "optimizer": "adam", "steps": 25,
     "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 10,
                "cycle_momentum": False}},
    {"name": "one_cycle_sgd", "type": "OneCycle", "optimizer": "sgd", "steps": 25,
     "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 10}},
    {"name": "one_cycle_two_groups", "type": "OneCycle", "optimizer": "adam", "groups": 2, "steps": 22,
     "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 10,
                "decay_step_size": 2, "decay_lr_rate": 0.1}},
    {"name": "one_cycle_defaults_jumps", "type": "OneCycle", "optimizer": "adam",
     "steps": [0, 1, 999, 1998, 1999, 2000, 2001, 3998, 3999, 4000, 4100, 9999, 5],
     "params": {"cycle_min_lr": 1e-5, "cycle_max_lr": 1e-3, "decay_step_size": 100, "decay_lr_rate": 0.1,
                "decay_mom_rate": 0.001}},
    {"name": "one_cycle_resumed_position", "type": "OneCycle", "optimizer": "adam", "steps": 12,
     "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 10,
                "last_batch_iteration": 14}},
    # LRRangeTest.
    {"name": "lr_range_test_continuous", "type": "LRRangeTest", "optimizer": "adam", "steps": 20,
     "params": {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 5, "lr_range_test_step_rate": 2.0}},
    {"name": "lr_range_test_staircase", "type": "LRRangeTest", "optimizer": "sgd", "steps": 20,
     "params": {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 5, "lr_range_test_step_rate": 2.0,
                "lr_range_test_staircase": True}},
    {"name": "lr_range_test_uneven", "type": "LRRangeTest", "optimizer": "adam", "groups": 2, "steps": 25,
     "params": {"lr_range_test_min_lr": 0.0007, "lr_range_test_step_size": 3, "lr_range_test_step_rate": 0.3,
                "lr_range_test_staircase": True}},
    {"name": "lr_range_test_defaults_jumps", "type": "LRRangeTest", "optimizer": "adam",
     "steps": [0, 1, 1998, 1999, 2000, 4001, 100000], "params": {}},
]


def optimizer_for(case: dict) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))]} for _ in range(case.get("groups", 1))]
    if case["optimizer"] == "adam":
        return torch.optim.Adam(groups, lr=0.5, betas=(0.9, 0.999))
    return torch.optim.SGD(groups, lr=0.5, momentum=0.9)


def groups_of(optimizer: torch.optim.Optimizer) -> list[dict]:
    keys = ("lr", "betas", "momentum")
    return [{k: list(g[k]) if k == "betas" else g[k] for k in keys if k in g} for g in optimizer.param_groups]


def run(case: dict) -> dict:
    optimizer = optimizer_for(case)
    schedule = getattr(lr_schedules, case["type"])(optimizer, **case["params"])
    record = {**case, "initial": groups_of(optimizer), "after_steps": [], "last_lr": []}
    steps = case["steps"]
    for iteration in [None] * steps if isinstance(steps, int) else steps:
        schedule.step(iteration)  # None: the next one
        record["after_steps"].append(groups_of(optimizer))
        record["last_lr"].append(list(schedule.get_last_lr()))
    return record


def signature(schedule: str) -> dict:
    """The keyword arguments (the config's params) with their defaults; "required" where there is none."""
    parameters = inspect.signature(getattr(lr_schedules, schedule)).parameters
    return {
        name: "required" if p.default is inspect.Parameter.empty else p.default
        for name, p in parameters.items() if name != "optimizer"
    }


def main() -> None:
    version = json.dumps(deepspeed.__version__)
    params = json.dumps({schedule: signature(schedule) for schedule in ("OneCycle", "LRRangeTest")})
    cases = ",\n".join(json.dumps(run(case)) for case in CASES)  # one line per case
    OUTPUT.write_text(f'{{"deepspeed": {version}, "params": {params}, "cases": [\n{cases}\n]}}\n')
    print(f"wrote {len(CASES)} cases to {OUTPUT}")


if __name__ == "__main__":
    main()
