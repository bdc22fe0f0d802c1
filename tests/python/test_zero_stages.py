"""ZeRO stages 0, 1 and 2 in fp32 match a single-process run over the same
global batches: the loss at every step and the final parameters."""

import pytest

from distributed import run_ranks
from training import relative_error, train_reference, train_zcore, zcore_config

STEPS = 20
TOLERANCE = 1e-5
# (model, accumulation steps, clipping): clipping at 0.05 engages on most steps.
VARIANTS = [("gpt", 1, 0.0), ("gpt", 2, 0.05), ("mlp", 1, 0.05), ("mlp", 2, 0.0)]


def run_all_variants(rank, world, stages):
    return {
        (model, gas, clip, stage): train_zcore(rank, world, model, zcore_config(stage, gas, clip), STEPS)
        for stage in stages
        for model, gas, clip in VARIANTS
    }


@pytest.fixture(scope="module")
def references():
    return {(m, clip): train_reference(m, clip, STEPS) for m, _, clip in VARIANTS}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_stages_match_single_process(world, references):
    results = run_ranks(run_all_variants, world, [0, 1, 2], launcher=world > 1, timeout=600)
    for (model, gas, clip, stage), got in results[0].items():
        ref = references[(model, clip)]
        label = f"{model} stage {stage} world {world} gas {gas} clip {clip}"
        assert got["engine_steps"] == STEPS, label
        for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
            assert abs(a - b) <= TOLERANCE * abs(b), f"{label}: step {step} loss {a} vs {b}"
        assert got["params"].keys() == ref["params"].keys()
        for name, value in got["params"].items():
            err = relative_error(value, ref["params"][name])
            assert err <= TOLERANCE, f"{label}: parameter {name} off by {err:.2e}"
    for other in results[1:]:  # every rank ends with the same parameters
        for key, got in other.items():
            for name, value in got["params"].items():
                assert relative_error(value, results[0][key]["params"][name]) == 0.0
