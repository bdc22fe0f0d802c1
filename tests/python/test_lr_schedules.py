"""DeepSpeed's schedules, checked against their formulas written out by hand."""

import math

import pytest
import torch

from zcore.config.schema import load_config
from zcore.optim.lr_schedules import SCHEDULES


def schedule(kind, params, lr=0.1):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    cfg = load_config({"train_batch_size": 1, "scheduler": {"type": kind, "params": params}})
    return opt, SCHEDULES[kind](opt, cfg.scheduler.params)


def lrs_over(opt, sched, steps):
    out = []
    for _ in range(steps):
        sched.step()
        out.append(opt.param_groups[0]["lr"])
    return out


def test_warmup_lr_log_and_linear():
    opt, sched = schedule("WarmupLR", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.5, "warmup_num_steps": 10})
    assert opt.param_groups[0]["lr"] == 0.01  # before the first step
    got = lrs_over(opt, sched, 15)
    want = [0.01 + 0.49 * min(1.0, math.log(i + 1) / math.log(10)) for i in range(15)]
    assert got == pytest.approx(want)
    opt, sched = schedule("WarmupLR", {"warmup_num_steps": 4, "warmup_type": "linear"}, lr=0.2)
    assert lrs_over(opt, sched, 6) == pytest.approx([0.0, 0.05, 0.1, 0.15, 0.2, 0.2])


def test_warmup_decay_lr_reaches_zero_at_the_end():
    opt, sched = schedule(
        "WarmupDecayLR",
        {"total_num_steps": 10, "warmup_num_steps": 4, "warmup_max_lr": 1.0, "warmup_type": "linear"},
    )
    got = lrs_over(opt, sched, 12)
    want = [0.0, 0.25, 0.5, 0.75] + [max(0.0, (10 - i) / 6) for i in range(4, 12)]
    assert got == pytest.approx(want)


def test_warmup_cosine_lr_is_a_ratio_of_the_base_lr():
    opt, sched = schedule(
        "WarmupCosineLR",
        {"total_num_steps": 12, "warmup_num_steps": 2, "warmup_type": "linear", "cos_min_ratio": 0.1},
        lr=0.4,
    )
    got = lrs_over(opt, sched, 14)
    want = [0.0, 0.2]
    for i in range(2, 14):
        progress = min(1.0, (i - 2 + 1) / 10)
        want.append(0.4 * (0.1 + 0.9 * (1 + math.cos(math.pi * progress)) / 2))
    assert got == pytest.approx(want)
    assert got[-1] == pytest.approx(0.04)


def test_state_dict_round_trip():
    opt, sched = schedule("WarmupLR", {"warmup_num_steps": 100})
    lrs_over(opt, sched, 7)
    opt2, sched2 = schedule("WarmupLR", {"warmup_num_steps": 100})
    sched2.load_state_dict(sched.state_dict())
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
