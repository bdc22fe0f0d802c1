"""ZeRO stage 3 with activation checkpointing (torch.utils.checkpoint on every
block of the tiny GPT, non-reentrant and reentrant) matches a single-process
torch.optim.AdamW run of the same checkpointed model (loss at every step,
final parameters, 1e-5 relative over 20 steps), with the default settings
and with a live budget that forces releases, reuse distance 0 and
accumulation with clipping. A recomputation saves plain views of the
gathered buffers, so zcore keeps them in place until the matching backward
is done: released or moved early, the gradients would be wrong. Memory stays
within the persistent groups plus the larger of the live budget and one
block (a recomputed block is in use as a whole) plus the prefetch bucket.
Stages 1 and 2 only see the gradients, and are checked too."""

import pytest

from distributed import run_ranks
from models import make_model
from training import (
    BUCKET,
    LIVE,
    ON_DEMAND,
    TIGHT,
    assert_matches,
    relative_error,
    train_reference,
    train_zcore,
    zcore_config,
)

STEPS = 20
TOLERANCE = 1e-5
# (label, model, stage, accumulation, clipping, zero_optimization keys)
VARIANTS = [
    ("stage 3", "gpt_checkpointed", 3, 1, 0.0, ON_DEMAND),
    ("stage 3 tight", "gpt_checkpointed", 3, 2, 0.05, TIGHT),
    ("stage 3 reentrant tight", "gpt_checkpointed_reentrant", 3, 1, 0.0, TIGHT),
    ("stage 2", "gpt_checkpointed", 2, 2, 0.05, {}),
    ("stage 1 reentrant", "gpt_checkpointed_reentrant", 1, 1, 0.0, {}),
]


def run_variants(rank, world):
    return {
        label: train_zcore(rank, world, model, zcore_config(stage, gas, clip, zero=keys), STEPS)
        for label, model, stage, gas, clip, keys in VARIANTS
    }


def block_elements(world: int) -> int:
    """Gathered elements of one block: its groups, each padded to the world size."""
    block = make_model("gpt_checkpointed").blocks[0]
    groups = [list(m.parameters(recurse=False)) for m in block.modules()]
    return sum(-(-sum(p.numel() for p in g) // world) * world for g in groups if g)


@pytest.mark.parametrize("world", [1, 2])
def test_checkpointed_gpt_matches_single_process(world):
    results = run_ranks(run_variants, world, launcher=world > 1, timeout=600)
    for label, model, stage, gas, clip, _ in VARIANTS:
        got = results[0][label]
        ref = train_reference(model, clip, STEPS, world, gas)
        tag = f"{label} world {world}"
        assert got["global_steps"] == STEPS and got["skipped_steps"] == 0, tag
        assert_matches(got, ref, TOLERANCE, tag)
        for other in results[1:]:
            for name, value in other[label]["params"].items():
                assert relative_error(value, got["params"][name]) == 0.0, tag
    bound = (max(LIVE, block_elements(world)) + BUCKET) * 4
    for rank_results in results:
        for label in ("stage 3 tight", "stage 3 reentrant tight"):
            s = rank_results[label]["gather_stats"]
            assert s.gathered_bytes == 0, label  # every recomputation's groups were let go
            assert s.trace_departures == 0, label  # recomputations follow the trace like any use
            assert s.peak_gathered_bytes <= s.persistent_bytes + bound, label
