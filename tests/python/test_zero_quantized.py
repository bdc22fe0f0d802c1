"""ZeRO++'s quantized collectives (zcore.comm.quantized_collectives): qwZ
(``zero_quantized_weights``: int8 weight all-gathers) and qgZ
(``zero_quantized_gradients``: int4 gradient reduce-scatters) train as
the unquantized engine does, within a tolerance the quantization error
explains; they refuse the stages where they mean nothing.

The tolerance. A quantized element is off by at most half its block's
scale: 1/254 of the block's largest magnitude for int8 weights (blocks
of 2048), 1/14 for int4 gradients (blocks of 64). Weight errors are
zero-mean from step to step and barely show (10-step means of the loss
within 0.1% of the unquantized run's, measured here). Gradient entries
under 1/14 of their block's largest round to zero, a small bias that
slows training a little: with blocks of 64, 10-step means stayed within
0.5% and the final evaluation loss within 0.2% (blocks of 512: 1.2% and
1.6%, which is why they are 64). The test allows the issue's 1% on
10-step means and on the evaluation loss; a real fault (a wrong scale, a
dropped or misplaced slice, a rank's gradient counted twice) moves the
loss by several percent within a few steps here.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch
import torch.nn.functional as F

import zcore
from distributed import run_ranks
from models import TinyGPT

STEPS, MICRO, SEQ, VOCAB = 100, 4, 16, 64
# Held-out sequences for the evaluation loss: many, so that it measures
# the model rather than one small batch.
EVAL_ROWS = 512


def sequences(step: int, rank: int, rows: int = MICRO) -> torch.Tensor:
    """Learnable tokens: each sequence counts up by a stride of its own from
    a random start, so the loss falls well below log(VOCAB)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    start = torch.randint(0, VOCAB, (rows, 1), generator=g)
    stride = torch.randint(1, 4, (rows, 1), generator=g)
    return (start + stride * torch.arange(SEQ + 1)) % VOCAB


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def config(stage: int, weights: bool, gradients: bool, zero: Optional[dict] = None, **extra) -> dict:
    """``zero``: more zero_optimization keys; ``extra``: more top-level keys."""
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.0,  # the tolerances below were measured unclipped
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 0,
            "zero_quantized_weights": weights,
            "zero_quantized_gradients": gradients,
            **(zero or {}),
        },
        **extra,
    }


def train(
    rank: int, stage: int, weights: bool, gradients: bool, precision: str, steps: int, zero: Optional[dict] = None
) -> dict:
    """This rank's losses, the evaluation loss and the final parameters
    (gathered as the engine gathers them)."""
    torch.manual_seed(0)
    model = TinyGPT()
    extra = {} if precision == "fp32" else {precision: {"enabled": True}}
    engine, *_ = zcore.initialize(model=model, config=config(stage, weights, gradients, zero, **extra),
                                  model_parameters=model.parameters())
    losses = []
    for step in range(steps):
        tokens = sequences(step, rank)
        loss = lm_loss(engine(tokens[:, :-1]), tokens)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.eval()
    with torch.no_grad():
        held_out = sequences(10_000, 0, rows=EVAL_ROWS)
        eval_loss = lm_loss(engine(held_out[:, :-1]), held_out).item()
    with zcore.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return {"losses": losses, "eval": eval_loss, "params": params}


def windows(losses: list[float], size: int = 10) -> list[float]:
    return [sum(losses[i : i + size]) / size for i in range(0, len(losses), size)]


def assert_trains_alike(run: dict, base: dict, rel: float = 0.01) -> None:
    assert base["losses"][-1] < 0.5 * base["losses"][0]  # it learns: the comparison means something
    for ours, theirs in zip(windows(run["losses"]), windows(base["losses"])):
        assert ours == pytest.approx(theirs, rel=rel)
    assert run["eval"] == pytest.approx(base["eval"], rel=rel)
    assert run["losses"] != base["losses"]  # quantization did change something


def train_both(rank: int, world: int, stage: int, weights: bool, gradients: bool, precision: str, steps: int):
    """The unquantized run, then the quantized one, in the same processes."""
    return train(rank, stage, False, False, precision, steps), train(rank, stage, weights, gradients, precision, steps)


@pytest.mark.parametrize(
    "world, stage, precision, weights, gradients, steps",
    [
        (4, 3, "fp32", True, True, STEPS),  # the run: the tied GPT, 100 steps
        (2, 3, "bf16", True, True, 60),
        (2, 2, "fp32", False, True, 60),
    ],
)
def test_quantized_collectives_train_as_the_unquantized_engine(world, stage, precision, weights, gradients, steps):
    base, run = run_ranks(train_both, world, stage, weights, gradients, precision, steps, timeout=300)[0]
    assert_trains_alike(run, base)


def overflow_is_skipped(rank: int, world: int) -> tuple:
    torch.manual_seed(0)
    model = TinyGPT()
    cfg = config(3, True, True, fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1})
    engine, *_ = zcore.initialize(model=model, config=cfg, model_parameters=model.parameters())
    before = engine.full_state_dict()
    tokens = sequences(0, rank)
    loss = lm_loss(engine(tokens[:, :-1]), tokens)
    engine.backward(loss * (float("inf") if rank == 1 else 1.0))  # one rank's gradients overflow
    engine.step()
    after = engine.full_state_dict()
    return engine.skipped_steps, engine.loss_scale, all(torch.equal(before[k], after[k]) for k in before)


def test_an_overflow_on_one_rank_survives_quantization_and_skips_the_step():
    for skipped, scale, unchanged in run_ranks(overflow_is_skipped, 2, timeout=300):
        assert skipped == 1 and scale == 128.0 and unchanged


@pytest.mark.parametrize(
    "zero, match",
    [
        ({"stage": 2, "zero_quantized_weights": True}, r"zero_quantized_weights.*stage is 2.*set the stage to 3"),
        ({"stage": 0, "zero_quantized_gradients": True}, r"zero_quantized_gradients.*stage 0 all-reduces"),
        ({"stage": 3, "mics_shard_size": 2}, r"mics_shard_size = 2 must divide the world size \(1\)"),
        ({"stage": 3, "zero_quantized_nontrainable_weights": True}, r"zero_quantized_nontrainable_weights"),
    ],
)
def test_combinations_that_cannot_work_are_refused(zero, match):
    with pytest.raises(zcore.ConfigError, match=match):
        zcore.initialize(model=TinyGPT(), config={"train_batch_size": 4, "zero_optimization": zero})


def test_deepspeeds_defaults_for_the_keys_zcore_lacks_are_accepted():
    cfg = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 1, "mics_shard_size": -1,
                                 "mics_hierarchical_params_gather": False,
                                 "zero_quantized_nontrainable_weights": False}}
    model = TinyGPT()
    engine, *_ = zcore.initialize(model=model, config=cfg, model_parameters=model.parameters())
    engine.destroy()
