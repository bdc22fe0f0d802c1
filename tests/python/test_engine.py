"""The engine's API as a DeepSpeed user drives it: counters, accumulation
boundaries, schedulers, optimizers passed in, data loading, and errors."""

import os
import time

import pytest
import torch
from torch import nn

import zcore
from distributed import run_ranks


def small_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def batch(step):
    gen = torch.Generator().manual_seed(step)
    return torch.randn(4, 8, generator=gen), torch.randn(4, 2, generator=gen)


def check_counters_and_schedule(rank, world):
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 3,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_type": "linear"}},
        "zero_optimization": {"stage": 1},
    }
    model = small_model()
    engine, optimizer, loader, scheduler = zcore.initialize(model=model, config=config)
    assert engine.module is model and optimizer is engine.optimizer and loader is None
    assert engine.train_batch_size() == 12 and engine.zero_stage == 1
    boundaries, lrs = [], []
    for micro in range(6):
        x, y = batch(micro)
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
        lrs.append(engine.get_lr()[0])
    assert boundaries == [False, False, True, False, False, True]
    assert engine.global_steps == 2 and engine.micro_steps == 6 and engine.global_samples == 24
    # WarmupLR (linear, 4 steps, max = the optimizer's lr), as DeepSpeed steps
    # it: min lr at construction, and step() after the k-th optimizer step
    # sets k-1 quarters of the way: 0, then 0.025.
    assert lrs == pytest.approx([0.0, 0.0, 0.0, 0.0, 0.0, 0.025])
    assert scheduler.get_last_lr() == pytest.approx([0.025])
    engine.eval()
    assert not model.training
    engine.train()
    assert model.training
    with pytest.raises(ValueError, match="scalar loss"):
        engine.backward(torch.ones(3, requires_grad=True))
    return True


def reference_steps(make_optimizer, steps):
    model = small_model()
    opt = make_optimizer(model)
    for step in range(steps):
        x, y = batch(step)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def grouped_adamw(model):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=0.05
    )


def check_user_optimizers(rank, world):
    steps = 5
    expected = reference_steps(grouped_adamw, steps)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "zero_optimization": {"stage": 2}}
    for how in ("instance", "callable"):
        model = small_model()
        if how == "instance":
            user_opt = grouped_adamw(model)
            halve = torch.optim.lr_scheduler.LambdaLR(user_opt, lambda s: 1.0)
            engine, opt, _, _ = zcore.initialize(model=model, config=config, optimizer=user_opt, lr_scheduler=halve)
            assert opt.inner is user_opt and engine.lr_scheduler is halve
        else:
            def build(groups):
                return torch.optim.AdamW(groups, lr=0.05)

            decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
            no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
            groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
            engine, _, _, _ = zcore.initialize(
                model=model, config=config, optimizer=build, model_parameters=groups
            )
        for step in range(steps):
            x, y = batch(step)
            engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()
        for got, want in zip(model.parameters(), expected):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    return True


def check_errors_and_data(rank, world):
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam"}}
    model = small_model()
    with pytest.raises(zcore.ConfigError, match="both configured"):
        zcore.initialize(model=model, config=config, optimizer=torch.optim.Adam(model.parameters()))
    model = small_model()
    only_first = torch.optim.Adam(model[0].parameters())
    with pytest.raises(ValueError, match=r"require grad but are in no optimizer group"):
        zcore.initialize(model=model, config={"train_batch_size": 2}, optimizer=only_first)
    model = small_model()
    stepped = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(1, 8)).sum().backward()
    stepped = torch.optim.Adam(model.parameters())
    stepped.step()
    with pytest.raises(ValueError, match="already has state"):
        zcore.initialize(model=model, config={"train_batch_size": 2}, optimizer=stepped)
    model = small_model()
    with pytest.raises(zcore.ConfigError, match="zero_allow_untested_optimizer"):
        zcore.initialize(
            model=model,
            config={"train_batch_size": 2, "zero_optimization": {"stage": 1}},
            optimizer=torch.optim.LBFGS(model.parameters()),
        )
    # No optimizer anywhere: an inference engine (tests/python/test_zero_inference.py), which refuses to train.
    engine, optimizer, _, _ = zcore.initialize(model=small_model(), config={"train_batch_size": 2})
    assert optimizer is None
    with pytest.raises(zcore.InvalidStateError, match="no optimizer"):
        engine.backward(engine(torch.randn(1, 8)).sum())

    data = torch.utils.data.TensorDataset(torch.randn(10, 8), torch.randn(10, 2))
    model = small_model()
    engine, _, loader, _ = zcore.initialize(model=model, config=config, training_data=data)
    sizes = [len(x) for x, _ in loader]
    assert sizes == [2, 2, 2, 2, 2]
    check_misuse(engine, model, config)
    # DeepSpeed's dataloader_drop_last: 9 samples in micro-batches of 2, the last one (of 1) dropped.
    odd = torch.utils.data.TensorDataset(torch.randn(9, 8), torch.randn(9, 2))
    for drop_last, expected in ((False, [2, 2, 2, 2, 1]), (True, [2, 2, 2, 2])):
        _, _, loader, _ = zcore.initialize(model=small_model(), config={**config, "dataloader_drop_last": drop_last},
                                           training_data=odd)
        assert [len(x) for x, _ in loader] == expected, drop_last
    return True


def check_misuse(engine, model, config):
    """step() without backward() counts nothing; a wrapped model is not wrapped again."""
    with pytest.raises(zcore.InvalidStateError, match=r"without engine.backward\(loss\)"):
        engine.step()
    assert (engine.micro_steps, engine.global_steps) == (0, 0)
    x, y = batch(0)
    engine.backward(nn.functional.mse_loss(engine(x), y))
    engine.step()
    with pytest.raises(zcore.InvalidStateError, match="without engine.backward"):
        engine.step()
    assert engine.micro_steps == 1
    for wrapped in (model, nn.Sequential(model)):
        with pytest.raises(zcore.InvalidStateError, match="already called on"):
            zcore.initialize(model=wrapped, config=config)


def test_counters_boundaries_and_schedule_world1_without_launcher():
    assert run_ranks(check_counters_and_schedule, 1, launcher=False, timeout=120) == [True]


def test_user_optimizer_instance_and_callable_match_torch():
    assert run_ranks(check_user_optimizers, 1, launcher=False, timeout=120) == [True]


def check_schedulers_and_fresh_state(rank, world):
    """As DeepSpeed: a scheduler given as a callable is built on the torch
    optimizer; step(lr_kwargs) reaches the scheduler's step; a scheduler
    that raises finds the step taken and counted. A fresh Adagrad (which
    makes its state at construction) is taken, and trains as torch's."""
    from log_capture import capture_zcore_log

    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "zero_optimization": {"stage": 2}}

    def sgd(groups):
        return torch.optim.SGD(groups, lr=0.1)

    engine, _, _, scheduler = zcore.initialize(
        model=small_model(), config=config, optimizer=sgd,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.5),
    )
    for step in range(3):
        x, y = batch(step)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
    assert isinstance(scheduler, torch.optim.lr_scheduler.StepLR) and engine.get_lr() == [0.1 * 0.5**3]
    plateau, _, _, _ = zcore.initialize(
        model=small_model(), config=config, optimizer=sgd,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0),
    )
    for step in range(3):
        x, y = batch(0)
        plateau.backward(nn.functional.mse_loss(plateau(x), y) * 0 + 1.0)
        plateau.step(lr_kwargs={"metrics": 1.0})  # no improvement: halved after the first
    assert plateau.get_lr() == [0.1 * 0.5**2]
    plateau.backward(nn.functional.mse_loss(plateau(x), y))
    with pytest.raises(TypeError, match="metrics"):
        plateau.step()
    assert (plateau.global_steps, plateau.micro_step_phase) == (4, zcore.engine.engine.MicroStep.AWAITING_BACKWARD)

    model = small_model()
    reference = small_model()
    expected_opt = torch.optim.Adagrad(reference.parameters(), lr=0.1, initial_accumulator_value=0.1)
    engine, _, _, _ = zcore.initialize(
        model=model, config={**config, "zero_optimization": {"stage": 1}},
        optimizer=torch.optim.Adagrad(model.parameters(), lr=0.1, initial_accumulator_value=0.1),
    )
    log = capture_zcore_log()
    for step in range(4):
        x, y = batch(step)
        nn.functional.mse_loss(reference(x), y).backward()
        expected_opt.step()
        expected_opt.zero_grad()
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert not [m for m in log.messages if "frozen" in m]

    # A parameter frozen at initialize and unfrozen after: said once, by name.
    model = small_model()
    model[0].weight.requires_grad_(False)
    engine, _, _, _ = zcore.initialize(
        model=model, config={**config, "zero_optimization": {"stage": 1}}, optimizer=sgd
    )
    model[0].weight.requires_grad_(True)
    for step in range(2):
        x, y = batch(step)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
    (said,) = [m for m in log.messages if "frozen at zcore.initialize" in m]
    assert "0.weight" in said
    return True


def test_schedulers_lr_kwargs_and_optimizers_with_state_at_construction():
    assert run_ranks(check_schedulers_and_fresh_state, 1, launcher=False, timeout=120) == [True]


def test_errors_and_data_loader():
    assert run_ranks(check_errors_and_data, 1, launcher=False, timeout=120) == [True]


def die_after_first_step(rank, world):
    engine, _, _, _ = zcore.initialize(
        model=small_model(), config={"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW"},
                                     "zero_optimization": {"stage": 2}}
    )
    for step in range(3):
        if step == 1 and rank == 1:
            os._exit(3)
        x, y = batch(step)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
    return True


def test_a_dead_rank_fails_the_run_instead_of_hanging():
    start = time.monotonic()
    # Either the death itself is seen first, or rank 0 notices it in a collective.
    with pytest.raises(RuntimeError, match=r"rank 1 died with exit code 3|rank 0 failed"):
        run_ranks(die_after_first_step, 2, timeout=120)
    assert time.monotonic() - start < 60


class Named(nn.Sequential):
    """A model with attributes of its own, as a Hugging Face model has."""

    vocab = 8

    def describe(self) -> str:
        return f"{len(self)} layers"


def check_attributes_fall_through(rank, world):
    model = Named(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    engine, *_ = zcore.initialize(model=model, config={"train_batch_size": 2, "optimizer": {"type": "AdamW"}})
    assert engine.vocab == 8 and engine.describe() == "3 layers"
    assert engine.train_batch_size() == 2  # the engine's own names come first
    try:
        engine.nothing_here
    except AttributeError as exc:
        assert "'Engine' object has no attribute 'nothing_here'" in str(exc) and "Named" in str(exc)
    else:
        raise AssertionError("a name neither has must be an AttributeError")
    assert not hasattr(engine, "nothing_here")
    return True


def test_the_wrapped_modules_attributes_are_the_engines_as_in_deepspeed():
    assert run_ranks(check_attributes_fall_through, 1, launcher=False, timeout=120) == [True]


def boundary_set_by_the_caller(rank, world, stage):
    """Accumulation of 4 by the config, but the caller ends it after 2
    micro-batches of losses it already divided (as transformers' Trainer
    does at an epoch's end): one AdamW step on the mean of the 2 gradients."""
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    reference = nn.Linear(6, 3)
    reference.load_state_dict(model.state_dict())
    batches = [torch.randn(2, 6) for _ in range(2)]
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0)
    for x in batches:
        (reference(x).square().mean() / 2).backward()
    optimizer.step()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage}}
    engine, *_ = zcore.initialize(model=model, config=config)
    for i, x in enumerate(batches):
        engine.set_gradient_accumulation_boundary(i == len(batches) - 1)
        engine.backward(engine(x).square().mean() / 2, scale_wrt_gas=False)
        engine.step()
    state = engine.full_state_dict()
    return engine.global_steps, engine.accumulated_micro_steps, state, reference.state_dict()


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_the_caller_can_end_an_accumulation_as_in_deepspeed(stage):
    steps, pending, got, expected = run_ranks(boundary_set_by_the_caller, 1, stage, timeout=120)[0]
    assert (steps, pending) == (1, 0)
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-7)
