"""ZeRO-3 releases the groups of a module whose inputs take no gradient as
soon as its backward is done, not at the end of backward.

SideInputs has two such modules side by side, both larger than the rest:
the feature projection's backward runs first, then the embedding's. With
nothing prefetched or kept, backward never needs more than one group at a
time, so its peak of gathered memory is the largest group alone; were the
projection held to the end, the embedding would join it. Training still
matches single-process AdamW.
"""

import torch
import torch.distributed as dist

import zcore
from distributed import run_ranks
from models import forward, global_batch, loss_of, make_model
from training import assert_matches, rows, train_reference, zcore_config

STEPS = 6
WORLD = 2
TOLERANCE = 1e-5
ONE_AT_A_TIME = {
    "stage3_param_persistence_threshold": 0,
    "stage3_prefetch_bucket_size": 0,
    "stage3_max_reuse_distance": 0,
}


def train_measuring_backward(rank, world):
    engine, *_ = zcore.initialize(model=make_model("side"), config=zcore_config(3, 1, 0.0, zero=ONE_AT_A_TIME))
    batch = engine.train_batch_size()
    losses, peaks = [], []
    for step in range(STEPS):
        x, y = global_batch("side", step, batch)
        part = rows(rank, world, batch)
        loss = loss_of("side", forward("side", engine, x[part], step, rank), y[part])
        engine.residency.reset_peak()  # what forward left gathered is nothing
        engine.backward(loss)
        stats = engine.gather_stats()
        peaks.append((stats.peak_gathered_bytes, stats.peak_live_elements))
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    with zcore.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return {"losses": losses, "params": params, "peaks": peaks}


def padded(module: torch.nn.Module) -> int:
    """Elements of the module's group: its parameters, padded to the world size."""
    numel = sum(p.numel() for p in module.parameters())
    return -(-numel // WORLD) * WORLD


def test_modules_without_input_gradients_release_when_their_backward_is_done():
    results = run_ranks(train_measuring_backward, WORLD, timeout=300)
    ref = train_reference("side", 0.0, STEPS, WORLD, 1)
    model = make_model("side")
    largest = max(padded(m) for m in (model.emb, model.side, model.head))
    held_to_the_end = padded(model.side) + padded(model.emb)
    assert largest < held_to_the_end
    for rank, got in enumerate(results):
        assert_matches(got, ref, TOLERANCE, f"rank {rank}")
        for step, (peak_bytes, peak_elements) in enumerate(got["peaks"]):
            assert peak_elements == largest, (rank, step, peak_elements)
            assert peak_bytes == largest * 4, (rank, step, peak_bytes)
