"""A backward that raises part-way (Ctrl-C, a failing hook) leaves the
engine able to go on: the accumulation window's gradients are dropped, some
of them reduced and some not, and a warning says so; running the window's
micro-batches again trains as if nothing had happened.

Every rank raises at the same place, from a tensor hook on the first
block's output, once the later blocks' gradients have been reduced (and, at
stage 3, their groups gathered and released). The reference is
single-process torch AdamW over the same global batches (training.py),
within 1e-5, as the other training tests.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import zcore
from distributed import run_ranks
from log_capture import capture_zcore_log
from models import global_batch, loss_of, make_model
from training import ON_DEMAND, TIGHT, assert_matches, rows, train_reference, zcore_config

MODEL = "gpt"
STEPS, INTERRUPTED_STEP = 4, 2
TOLERANCE = 1e-5


class Interrupt(Exception):
    """Stands for KeyboardInterrupt, which pytest would take as the user's."""


def interrupt_at_the_first_block(engine) -> list:
    """A one-shot hook: the next backward raises once it reaches the first
    block's output."""
    armed = [True]

    def on_output(module, args, output):
        if armed[0] and output.requires_grad:
            def raise_once(grad):
                armed[0] = False
                raise Interrupt("interrupted part-way through backward")

            output.register_hook(raise_once)

    engine.module.blocks[0].register_forward_hook(on_output)
    return armed


def micro_batch(engine, step: int, m: int, rank: int, world: int) -> float:
    gas = engine.gradient_accumulation_steps()
    x, y = global_batch(MODEL, step, engine.train_batch_size())
    part = rows(m * world + rank, world * gas)
    loss = loss_of(MODEL, engine(x[part]), y[part])
    engine.backward(loss)
    engine.step()
    return loss.item()


def train_interrupted(rank: int, world: int, variants: dict, nvme: str) -> dict:
    out = {}
    for label, (zero_stage, gas, zero) in variants.items():
        path = os.path.join(nvme, f"{label}-rank{rank}")
        os.makedirs(path, exist_ok=True)
        zero = {k: ({**v, "nvme_path": path} if isinstance(v, dict) else v) for k, v in zero.items()}
        engine, *_ = zcore.initialize(model=make_model(MODEL), config=zcore_config(zero_stage, gas, 0.0, zero=zero))
        armed = None
        log = capture_zcore_log()
        losses = []
        for step in range(STEPS):
            total = 0.0
            m = 0
            while m < gas:
                if step == INTERRUPTED_STEP and m == gas - 1 and armed is None:
                    armed = interrupt_at_the_first_block(engine)
                try:
                    total += micro_batch(engine, step, m, rank, world)
                except Interrupt:
                    total, m = 0.0, 0  # the window was dropped: run it again
                    continue
                m += 1
            losses.append(total / gas)
        summed = torch.tensor(losses)
        dist.all_reduce(summed)
        with zcore.GatheredParameters(list(engine.module.parameters())):
            params = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
        out[label] = {
            "losses": (summed / world).tolist(), "params": params, "interrupted": not armed[0],
            "warnings": [w for w in log.messages if "backward raised" in w], "global_steps": engine.global_steps,
        }
        engine.destroy()
    return out


NVME_BOTH = {"offload_param": {"device": "nvme", "max_in_cpu": 0}, "offload_optimizer": {"device": "nvme"},
             "sub_group_size": 5000, **ON_DEMAND}
VARIANTS = {
    "stage 1, accumulation 2": (1, 2, {}),
    "stage 2": (2, 1, {}),
    "stage 2, optimizer on NVMe": (2, 1, {"offload_optimizer": {"device": "nvme"}}),
    "stage 3, tight budget": (3, 1, TIGHT),
    "stage 3, all on NVMe, accumulation 2": (3, 2, NVME_BOTH),
}


def test_an_interrupted_backward_drops_its_window_and_training_goes_on_exactly(tmp_path) -> None:
    world = 2
    results = run_ranks(train_interrupted, world, VARIANTS, str(tmp_path), timeout=600)
    for label, (_, gas, _) in VARIANTS.items():
        got = results[0][label]
        assert got["interrupted"] and got["global_steps"] == STEPS, label
        (warning,) = got["warnings"]
        assert "backward raised Interrupt" in warning and "dropped" in warning, warning
        if gas > 1:
            assert f"the {gas - 1} before it" in warning, warning
        ref = train_reference(MODEL, 0.0, STEPS, world, gas)
        assert_matches(got, ref, TOLERANCE, label)
        for name, value in results[1][label]["params"].items():
            assert torch.equal(value, got["params"][name]), label
