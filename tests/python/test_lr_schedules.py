"""DeepSpeed's schedules: WarmupLR, WarmupDecayLR and WarmupCosineLR checked
against their formulas written out by hand; OneCycle and LRRangeTest against
what DeepSpeed's own classes set."""

import json
import logging
import math
import re
from pathlib import Path

import pytest
import torch

import zcore
from config_reference import EDGES, REFUSED, assert_holds, expected_config, names, problem_lines, refusal, variants
from distributed import run_ranks
from zcore.config.scheduler import LRRangeTestParams, OneCycleParams
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


# OneCycle and LRRangeTest, against DeepSpeed 0.19.8's own classes: the
# learning rates and momenta they set, recorded by
# data/make_lr_schedule_reference.py.
REFERENCE = json.loads((Path(__file__).parent / "data" / "lr_schedule_reference.json").read_text())
CASES = {case["name"]: case for case in REFERENCE["cases"]}


def with_params(schedule, params):
    return {"train_batch_size": 1, "scheduler": {"type": schedule, "params": params}}


def reference_optimizer(case):
    """The optimizer data/make_lr_schedule_reference.py gives DeepSpeed's schedule."""
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))]} for _ in range(case.get("groups", 1))]
    if case["optimizer"] == "adam":
        return torch.optim.Adam(groups, lr=0.5, betas=(0.9, 0.999))
    return torch.optim.SGD(groups, lr=0.5, momentum=0.9)


def groups_of(optimizer):
    """As the reference records them: betas as lists."""
    keys = ("lr", "betas", "momentum")
    return [{k: list(g[k]) if k == "betas" else g[k] for k in keys if k in g} for g in optimizer.param_groups]


def test_reference_is_deepspeeds():
    assert REFERENCE["deepspeed"] == "0.19.8"
    assert {case["type"] for case in REFERENCE["cases"]} == {"OneCycle", "LRRangeTest"}


@pytest.mark.parametrize(
    ("schedule", "section"), [("OneCycle", OneCycleParams), ("LRRangeTest", LRRangeTestParams)]
)
def test_params_are_deepspeeds_keyword_arguments(schedule, section):
    """The config's params are DeepSpeed's keyword arguments, with its defaults."""
    deepspeed = REFERENCE["params"][schedule]
    assert list(section.model_fields) == list(deepspeed)
    for name, field in section.model_fields.items():
        if deepspeed[name] == "required":
            assert field.is_required(), name
        else:
            assert not field.is_required() and field.default == deepspeed[name], name
            assert type(field.default) is type(deepspeed[name]), name


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_deepspeed(name):
    case = CASES[name]
    optimizer = reference_optimizer(case)
    cfg = load_config(with_params(case["type"], case["params"]))
    schedule = SCHEDULES[case["type"]](optimizer, cfg.scheduler.params)
    if cfg.scheduler.params.last_batch_iteration == -1:
        # DeepSpeed leaves the optimizer alone when built at another position;
        # zcore sets that position's values (test_one_cycle_built_at_a_position_sets_its_values).
        assert groups_of(optimizer) == case["initial"]
    steps = case["steps"]
    iterations = [None] * steps if isinstance(steps, int) else steps
    for i, iteration in enumerate(iterations):
        schedule.step(iteration)
        assert groups_of(optimizer) == case["after_steps"][i], f"after step {i} ({iteration=})"
        assert schedule.get_last_lr() == case["last_lr"][i]


def test_one_cycle_built_at_a_position_sets_its_values():
    """Built at last_batch_iteration 14 (a resume), the optimizer holds what
    DeepSpeed's step to 14 sets."""
    case = CASES["one_cycle_continuous"]
    optimizer = reference_optimizer(case)
    params = {**case["params"], "last_batch_iteration": 14}
    cfg = load_config(with_params("OneCycle", params))
    schedule = SCHEDULES["OneCycle"](optimizer, cfg.scheduler.params)
    assert groups_of(optimizer) == case["after_steps"][14]
    assert schedule.get_last_lr() == case["last_lr"][14]


@pytest.mark.parametrize("name", ["one_cycle_decay", "one_cycle_staircase", "lr_range_test_staircase"])
def test_state_dict_resumes_the_schedule(name):
    case = CASES[name]
    cfg = load_config(with_params(case["type"], case["params"]))
    first = SCHEDULES[case["type"]](reference_optimizer(case), cfg.scheduler.params)
    for _ in range(17):
        first.step()
    optimizer = reference_optimizer(case)
    resumed = SCHEDULES[case["type"]](optimizer, cfg.scheduler.params)
    resumed.load_state_dict(first.state_dict())
    assert groups_of(optimizer) == case["after_steps"][16]
    resumed.step()
    assert groups_of(optimizer) == case["after_steps"][17]
    # Saved before the first step: DeepSpeed's starting values (OneCycle's
    # cycle_min_mom, not the cycle_max_mom of the cycle's start).
    resumed.load_state_dict({"last_batch_iteration": -1})
    assert groups_of(optimizer) == case["initial"]


def test_one_cycle_leaves_an_sgd_momentum_alone(caplog):
    case = CASES["one_cycle_sgd"]
    optimizer = reference_optimizer(case)
    cfg = load_config(with_params("OneCycle", case["params"]))
    with caplog.at_level(logging.WARNING, logger="zcore"):
        schedule = SCHEDULES["OneCycle"](optimizer, cfg.scheduler.params)
    assert "cycle_momentum is off" in caplog.text and not schedule.cycle_momentum
    assert schedule.get_mom() is None


@pytest.mark.parametrize(
    ("scheduler", "key"),
    [
        ({"type": "OneCycle", "params": {"cycle_min_lr": 0.1}}, "scheduler.params.cycle_max_lr"),
        ({"type": "OneCycle"}, "scheduler.params"),
        ({"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_first_step_size": 0}},
         "scheduler.params.cycle_first_step_size"),
        ({"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_second_step_size": -1}},
         "scheduler.params.cycle_second_step_size"),
        ({"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "decay_step_size": -1}},
         "scheduler.params.decay_step_size"),
        ({"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_momentum": 2}},
         "scheduler.params.cycle_momentum"),
        ({"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "warmup_num_steps": 5}},
         "scheduler.params.warmup_num_steps"),
        ({"type": "LRRangeTest", "params": {"lr_range_test_step_size": 0}}, "scheduler.params.lr_range_test_step_size"),
        ({"type": "LRRangeTest", "params": {"lr_range_test_step_size": 2.5}},
         "scheduler.params.lr_range_test_step_size"),
    ],
)
def test_bad_params_are_named(scheduler, key):
    with pytest.raises(zcore.ConfigError, match=re.escape(key)):
        load_config({"train_batch_size": 1, "scheduler": scheduler})


# Every key of each new section, set to the values that bound or coerce:
# taken as config_reference.py's Scheduler states (the coercions DeepSpeed's
# configs rely on), or refused naming the key. (test_config_fuzz.py fuzzes
# the base config's scheduler, a WarmupDecayLR.)
FULL_PARAMS = {
    "OneCycle": {
        "cycle_min_lr": 1e-5, "cycle_max_lr": 1e-3, "decay_lr_rate": 0.001, "cycle_first_step_size": 1000,
        "cycle_second_step_size": 500, "cycle_first_stair_count": 10, "cycle_second_stair_count": 10,
        "decay_step_size": 100, "cycle_momentum": False, "cycle_min_mom": 0.85, "cycle_max_mom": 0.95,
        "decay_mom_rate": 0.001, "last_batch_iteration": -1,
    },
    "LRRangeTest": {
        "lr_range_test_min_lr": 1e-5, "lr_range_test_step_size": 500, "lr_range_test_step_rate": 5.0,
        "lr_range_test_staircase": True, "last_batch_iteration": -1,
    },
}


@pytest.mark.parametrize(
    ("schedule", "key"), [(schedule, key) for schedule, params in FULL_PARAMS.items() for key in params]
)
def test_each_key_takes_what_the_reference_model_states(schedule, key):
    params = FULL_PARAMS[schedule]
    assert_holds(expected_config(with_params(schedule, params)), load_config(with_params(schedule, params)))
    for value in [*EDGES, *variants(params[key]), 0.5, "1e3", " 7 ", "yes", [1], {}]:
        config = with_params(schedule, {**params, key: value})
        expected = expected_config(config)
        if expected is REFUSED:
            message = refusal(config)
            assert all(names(line, f"scheduler.params.{key}") for line in problem_lines(message)), (value, message)
        else:
            assert_holds(expected, load_config(config))
    without = {k: v for k, v in params.items() if k != key}
    expected = expected_config(with_params(schedule, without))
    if expected is REFUSED:
        assert key in ("cycle_min_lr", "cycle_max_lr")
        assert f"scheduler.params.{key}" in refusal(with_params(schedule, without))
    else:
        assert_holds(expected, load_config(with_params(schedule, without)))


# Through zcore.initialize, in a world of one: the engine's learning rate and
# betas follow DeepSpeed's schedule, and a checkpoint resumes it.
ENGINE_CASES = ("one_cycle_continuous", "lr_range_test_continuous")
SAVED_AT = 3


def engine_for(case):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 0.5, "betas": [0.9, 0.999]}},
        "scheduler": {"type": case["type"], "params": case["params"]},
        "zero_optimization": {"stage": 2},
    }
    engine, *_ = zcore.initialize(model=model, config=config)
    return engine


def train_steps(engine, steps):
    """The optimizer's groups (as the reference records them) after each step."""
    out = []
    for step in range(steps):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(step))
        engine.backward(engine(x).square().mean())
        engine.step()
        out.append(groups_of(engine.optimizer))
    return out


def schedule_through_engine(rank, world, name, ckpt):
    case = CASES[name]
    engine = engine_for(case)
    record = {"initial": groups_of(engine.optimizer), "before_save": train_steps(engine, SAVED_AT)}
    engine.save_checkpoint(ckpt)
    resumed = engine_for(case)
    resumed.load_checkpoint(ckpt)
    record["loaded"] = groups_of(resumed.optimizer)
    record["state"] = resumed.lr_scheduler.state_dict()
    record["after_load"] = train_steps(resumed, 3)
    return record


@pytest.mark.parametrize("name", ENGINE_CASES)
def test_engine_follows_and_resumes_the_schedule(tmp_path, name):
    case = CASES[name]
    (record,) = run_ranks(schedule_through_engine, 1, name, str(tmp_path / "ckpt"), launcher=False, timeout=300)
    assert record["initial"] == case["initial"]
    assert record["before_save"] == case["after_steps"][:SAVED_AT]
    assert record["state"] == {"last_batch_iteration": SAVED_AT - 1}
    assert record["loaded"] == case["after_steps"][SAVED_AT - 1]
    assert record["after_load"] == case["after_steps"][SAVED_AT:SAVED_AT + 3]


def schedulers_given_as_objects(rank, world):
    """A scheduler over the optimizer given to zcore.initialize drives the
    engine's learning rate; one over another optimizer is refused."""
    out = {}
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    engine, _, _, returned = zcore.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                              config={"train_batch_size": 2})
    for _ in range(2):
        engine.backward(engine(torch.ones(2, 4)).sum())
        engine.step()
    out["driven"] = (returned is scheduler, engine.get_lr())
    engine.destroy()
    other = torch.nn.Linear(4, 2)
    foreign = torch.optim.lr_scheduler.LambdaLR(torch.optim.Adam(other.parameters()), lambda step: 1.0)
    try:
        zcore.initialize(model=other, lr_scheduler=foreign,
                         config={"train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})
        out["foreign"] = "accepted"
    except zcore.ConfigError as exc:
        out["foreign"] = str(exc)
    return out


def test_a_scheduler_object_must_drive_the_engines_optimizer():
    (got,) = run_ranks(schedulers_given_as_objects, 1, launcher=False)
    assert got["driven"] == (True, [pytest.approx(1e-2 * 0.25)])
    assert "not the optimizer the engine steps" in got["foreign"] and "callable" in got["foreign"], got["foreign"]
