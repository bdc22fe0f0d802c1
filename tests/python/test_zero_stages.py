"""ZeRO stages 0, 1 and 2 in fp32, with and without CPU optimizer offload,
match a single-process run over the same global batches: the loss at every
step and the final parameters, within 1e-5 relative over 20 steps. World 1
runs on ZCORE_TEST_DEVICE (NCCL on a GPU), against torch's AdamW there."""

import pytest

import devices
from distributed import run_ranks
from training import assert_matches, relative_error, train_reference, train_zcore, zcore_config

STEPS = 20
TOLERANCE = 1e-5
# (model, accumulation steps, clipping, CPU offload): clipping at 0.05
# engages on most steps.
VARIANTS = [
    ("gpt", 1, 0.0, False),
    ("gpt", 2, 0.05, False),
    ("gpt", 2, 0.05, True),
    ("mlp", 1, 0.05, False),
    ("mlp", 2, 0.0, True),
    ("branch", 1, 0.0, False),
    ("branch", 1, 0.0, True),
]


def run_all_variants(rank, world, stages, device):
    devices.init_process_group(device)
    return {
        (model, gas, clip, offload, stage): train_zcore(
            rank, world, model, zcore_config(stage, gas, clip, offload=offload), STEPS
        )
        for stage in stages
        for model, gas, clip, offload in VARIANTS
    }


@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.device), 2, 4])
def test_stages_match_single_process(world, device):
    results = run_ranks(run_all_variants, world, [0, 1, 2], device, launcher=world > 1, timeout=600)
    references = {}
    for (model, gas, clip, offload, stage), got in results[0].items():
        key = (model, gas, clip)
        if key not in references:
            references[key] = train_reference(model, clip, STEPS, world, gas, device=device)
        label = f"{model} stage {stage} world {world} gas {gas} clip {clip} offload {offload} on {device}"
        assert got["device"] == (device, devices.BACKENDS[device]), label
        assert got["global_steps"] == STEPS and got["skipped_steps"] == 0, label
        expected = ("CPUAdam", "FusedCpuUpdate") if offload else ("AdamW", "TorchUpdate")
        assert (got["optimizer"], got["update"]) == expected, label
        assert_matches(got, references[key], TOLERANCE, label)
    for other in results[1:]:  # every rank ends with the same parameters
        for key, got in other.items():
            for name, value in got["params"].items():
                assert relative_error(value, results[0][key]["params"][name]) == 0.0
