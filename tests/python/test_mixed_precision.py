"""bf16 and fp16 training (stages 0-3) against a single-process mixed-precision reference,
and fp16 overflow handling.

Tolerances: both sides run the same bf16/fp16 forward and backward on the
same micro-batches and accumulate in fp32, so they differ only by the order
of fp32 gradient sums. That moves the fp32 master weights by ~1e-7 relative,
which now and then flips the rounding of a weight to the compute dtype by one
ulp (2^-8 relative in bf16, 2^-11 in fp16), and later steps carry the flip
on. The compared parameters are stored in the compute dtype, and in tensors
that start at zero (LayerNorm biases) a few flips are a large share of the
norm: measured over 20 steps, up to 4.4 ulps per tensor (1.7e-2 bf16, 2.3e-3
fp16); parameters must agree within 8 ulps. The loss averages over all
weights: measured 5.5e-5 (bf16) and 5.3e-6 (fp16), bounded with ~4x margin.
World 1 runs on ZCORE_TEST_DEVICE (NCCL on a GPU), against the reference
run there.
"""

import math

import pytest
import torch

import devices
import zcore
from distributed import run_ranks
from models import global_batch, loss_of, make_model
from training import assert_matches, train_reference, train_zcore, zcore_config
from zcore.step.precision import DynamicLossScaler

STEPS = 20
LOSS_TOLERANCE = {"bf16": 2e-4, "fp16": 2e-5}
PARAM_TOLERANCE = {"bf16": 8 * 2.0**-8, "fp16": 8 * 2.0**-11}
# (model, accumulation steps, clipping, CPU offload: the fused kernel writes
# the bf16/fp16 parameters in the same pass), by world size: world 1 (on
# the device) without the MLP, which adds nothing there.
VARIANTS = [("gpt", 2, 0.05, False), ("gpt", 2, 0.05, True), ("mlp", 1, 0.0, False)]
VARIANTS_AT = {1: VARIANTS[:2], 2: VARIANTS}


def precision_config(stage, gas, clip, precision, offload):
    # Stage 3: gathered and released per module, not kept whole.
    zero = {"stage3_param_persistence_threshold": 0} if stage == 3 else None
    return zcore_config(stage, gas, clip, precision, offload, zero=zero)


def run_precisions(rank, world, device):
    devices.init_process_group(device)
    return {
        (precision, model, gas, clip, offload, stage): train_zcore(
            rank, world, model, precision_config(stage, gas, clip, precision, offload), STEPS
        )
        for precision in ("bf16", "fp16")
        for stage in (0, 1, 2, 3)
        for model, gas, clip, offload in VARIANTS_AT[world]
    }


@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.device), 2])
def test_bf16_and_fp16_match_the_mixed_precision_reference(world, device):
    results = run_ranks(run_precisions, world, device, launcher=world > 1, timeout=600)
    references = {}
    for (precision, model, gas, clip, offload, stage), got in results[0].items():
        label = f"{precision} {model} stage {stage} gas {gas} clip {clip} offload {offload} world {world} on {device}"
        assert got["device"] == (device, devices.BACKENDS[device]), label
        assert got["skipped_steps"] == 0, label
        key = (precision, model, gas, clip)
        if key not in references:
            references[key] = train_reference(model, clip, STEPS, world, gas, precision, device=device)
        assert_matches(got, references[key], LOSS_TOLERANCE[precision], label, PARAM_TOLERANCE[precision])


def full_params(engine):
    with zcore.GatheredParameters(list(engine.module.parameters())):  # stage 3 keeps shards only
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def train_with_injected_inf(rank, world, stage, bad_step, bad_rank, device):
    devices.init_process_group(device)
    config = precision_config(stage, 1, 0.0, "fp16", False)
    config["fp16"].update(hysteresis=1)
    engine, _, _, _ = zcore.initialize(model=make_model("mlp"), config=config)
    devices.assert_on(engine, device)
    micro = engine.train_micro_batch_size_per_gpu()
    on = engine.context.device
    record = []
    for step in range(4):
        x, y = global_batch("mlp", step, world * micro)
        part = slice(rank * micro, (rank + 1) * micro)
        loss = loss_of("mlp", engine(x[part].half().to(on)), y[part].to(on))
        if step == bad_step and rank == bad_rank:
            loss = loss * math.inf  # every gradient on this rank becomes inf or nan
        before = full_params(engine)
        scale = engine.loss_scale
        engine.backward(loss)
        engine.step()
        after = full_params(engine)
        changed = any(not torch.equal(before[n], p) for n, p in after.items())
        record.append({"scale_before": scale, "scale_after": engine.loss_scale, "changed": changed})
    return {"record": record, "skipped": engine.skipped_steps, "steps": engine.global_steps}


def bf16_with_injected_inf(rank, world, stage, check):
    """bf16 without clipping, a rank's gradients inf at step 1."""
    config = precision_config(stage, 1, 0.0, "bf16", False)
    if check is not None:
        config["bf16"]["check_grad_overflow"] = check
    engine, _, _, _ = zcore.initialize(model=make_model("mlp"), config=config)
    micro = engine.train_micro_batch_size_per_gpu()
    finite = []
    for step in range(3):
        x, y = global_batch("mlp", step, world * micro)
        part = slice(rank * micro, (rank + 1) * micro)
        loss = loss_of("mlp", engine(x[part].bfloat16()), y[part])
        if step == 1 and rank == world - 1:
            loss = loss * math.inf
        engine.backward(loss)
        engine.step()
        finite.append(all(bool(p.isfinite().all()) for p in full_params(engine).values()))
    return {"skipped": engine.skipped_steps, "finite": finite}


@pytest.mark.parametrize("stage", [1, 3])
def test_bf16_skips_a_step_whose_gradients_are_not_finite_unless_told_not_to(stage):
    """DeepSpeed's bf16.check_grad_overflow (default true), with clipping
    off (clipping alone would also refuse a norm that is not finite)."""
    for check, skipped, finite in ((None, 1, [True, True, True]), (False, 0, [True, False, False])):
        for rank, got in enumerate(run_ranks(bf16_with_injected_inf, 2, stage, check, timeout=300)):
            assert (got["skipped"], got["finite"]) == (skipped, finite), (check, rank)


@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.device), 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp16_overflow_on_one_rank_skips_that_step_everywhere(stage, world, device):
    bad_step = 2
    results = run_ranks(train_with_injected_inf, world, stage, bad_step, world - 1, device,
                        launcher=world > 1, timeout=300)
    for rank, result in enumerate(results):
        assert result["skipped"] == 1 and result["steps"] == 4, f"rank {rank}"
        for step, r in enumerate(result["record"]):
            if step == bad_step:
                assert not r["changed"], f"rank {rank} updated on the overflowing step"
                assert r["scale_after"] == r["scale_before"] / 2
            else:
                assert r["changed"], f"rank {rank} skipped step {step}"
                assert r["scale_after"] == r["scale_before"]


def scales(window: int, hysteresis: int, overflows: list[bool]) -> list[float]:
    scaler = DynamicLossScaler(scale=1024.0, window=window, hysteresis=hysteresis, min_scale=1.0)
    out = []
    for overflow in overflows:
        scaler.update(overflow)
        out.append(scaler.scale)
    return out


def test_the_dynamic_loss_scale_follows_deepspeeds_schedule():
    """DeepSpeed 0.19.8 (runtime/fp16/loss_scaler.py): the scale doubles when
    the steps since the last overflow, less one, are a positive multiple of
    the window; written out here for window 2."""
    assert scales(2, 1, [False] * 6) == [1024, 1024, 2048, 2048, 4096, 4096]
    assert scales(2, 1, [False, False, True, False, False, False]) == [1024, 1024, 512, 512, 512, 1024]
    # Hysteresis 2: the first overflow is absorbed, the second halves.
    assert scales(3, 2, [True, True, False, False, False, False]) == [1024, 512, 512, 512, 512, 1024]


def reduce_near_fp16_max(rank, world, stage):
    """Each rank's scaled gradient is 40000: their fp16 sum (80000) is
    beyond fp16's 65504, their mean is not."""
    config = zcore_config(stage, 1, 0.0, "fp16", False)
    config["fp16"].update(loss_scale=40000.0)  # static: the scaled gradient is exactly 40000
    config["communication_data_type"] = "fp16"
    model = torch.nn.Linear(8, 1, bias=False)
    torch.nn.init.ones_(model.weight)
    engine, _, _, _ = zcore.initialize(model=model, config=config)
    loss = engine(torch.eye(8, dtype=torch.float16)).float().sum()  # d loss / d w = 1 per weight
    engine.backward(loss)
    engine.step()
    return {"skipped": engine.skipped_steps, "norm": float(engine.get_global_grad_norm())}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp16_gradients_are_averaged_before_their_fp16_sum_overflows(stage):
    """As DeepSpeed sends them: each rank's 16-bit gradient divided by the
    world size, then summed."""
    for result in run_ranks(reduce_near_fp16_max, 2, stage, timeout=300):
        assert result == {"skipped": 0, "norm": pytest.approx(math.sqrt(8))}
