"""ZeRO++ hpZ (``zero_hpz_partition_size``, zcore.zero3.secondary_partition) on
world 4 as 2 nodes x 2 ranks: exact against single-process torch AdamW,
its later gathers within the node, its secondaries dropped whenever the
shards change, and the configurations it cannot serve refused.

Bytes per step, counted on the process groups (zcore.comm.counting_group), on
TinyGPT with each use gathering its groups and releasing them at its exit
(stage3_max_live_parameters 0, stage3_max_reuse_distance 0). W = 4 ranks,
blocks of h = 2, c = 4 bytes per fp32 element, A = 2 micro-steps; P: the
groups' padded sizes summed; U: per use (module with parameters) its
groups' sizes summed, U = P + pad(wte) as the LM head uses the embedding's
group. Only the first gather of each group after a step goes over the
world; every other use of the step (the LM head's in the same forward, the
backward, the second micro-step) gathers within the block:
  world all-gather sends  (W-1)/W x c x P,
  block all-gather sends  (h-1)/h x c x (2 x A x U - P),
and the reduce-scatters and all-reduces on the world are plain stage 3's
(zcore's test_counting_group). With qwZ, each gather sends the rank's int8
slice (codes and scales) to each peer instead; a secondary as the primary
shards it holds, each quantized in its own blocks, so that a weight comes
back from a secondary with the codes of its first gather.
"""

from __future__ import annotations

import tempfile
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

import zcore
from distributed import run_ranks
from models import forward, global_batch, loss_of, make_model
from test_counting_group import quantized_bytes, stage3_layout
from training import TIGHT, assert_matches, rows, train_reference, train_zcore, zcore_config
from zcore.comm import counting_group
from zcore.comm.collectives import DistributedContext
from zcore.config.schema import load_config
from zcore.config.policies import policies_from_config
from zcore.comm.quantized_collectives import WEIGHT_BITS, WEIGHT_BLOCK

WORLD, HPZ = 4, 2
STEPS, TOLERANCE = 20, 1e-5
BATCH = 16  # world x accumulation 2 x 2 rows
ON_DEMAND = {"stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 0,
             "stage3_max_reuse_distance": 0, "zero_hpz_partition_size": HPZ}
# (label, model, zero_optimization keys): tied GPT, accumulation 2, fp32.
EXACT = [
    ("on demand", "gpt", ON_DEMAND),
    ("tight budget, activation checkpointing", "gpt_checkpointed", {**TIGHT, "zero_hpz_partition_size": HPZ}),
]
COUNTED = [("hpZ", ON_DEMAND), ("hpZ and qwZ", {**ON_DEMAND, "zero_quantized_weights": True})]


def secondaries(engine) -> tuple[int, int, int]:
    """Bytes of the secondaries held, what a full set of them takes, and the
    memory report's device parameter bytes less the shards'."""
    fetcher = engine.residency
    full_set = sum(g.padded_numel // HPZ * g.dtype.itemsize for g in fetcher.groups)
    shards = sum(g.local_shard.numel() * g.local_shard.element_size() for g in fetcher.groups)
    device = engine.memory_report().measured_tiers["device"].parameters
    return engine.gather_stats().secondary_bytes, full_set, device - shards


def counted_steps(rank: int, keys: dict) -> tuple[list, list]:
    """Per step after the first (which records the trace): what this rank
    sent on the world and on its block; the losses."""
    config = zcore_config(3, 2, 0.0, zero=keys, train_batch_size=BATCH)
    engine, *_ = zcore.initialize(model=make_model("gpt"), config=config)
    block = engine.residency.gathers.block
    sent, losses = [], []
    for step in range(3):
        counting_group.reset()
        counting_group.reset(block)
        x, y = global_batch("gpt", step, BATCH)
        for m in range(2):
            part = rows(m * WORLD + rank, WORLD * 2, BATCH)
            loss = loss_of("gpt", forward("gpt", engine, x[part], step, rank), y[part])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        sent.append((counting_group.counters(), counting_group.counters(block)))
    engine.destroy()
    return sent[1:], losses


def checkpoint_and_write_back(rank: int) -> dict:
    """Train 3 steps and save; train 2 more, gather every group (which takes
    secondaries of the trained values), load: the 3 steps after the load
    must be those of a run that never left the checkpoint. Then
    GatheredParameters(modifier_rank=0) zeroes a weight: the next gather
    must see the zeros, not the secondary taken before."""
    config = zcore_config(3, 1, 0.0, zero=ON_DEMAND, train_batch_size=8)

    def train(engine, steps) -> None:
        for step in steps:
            x, y = global_batch("gpt", step, 8)
            part = rows(rank, WORLD, 8)
            engine.backward(loss_of("gpt", forward("gpt", engine, x[part], step, rank), y[part]))
            engine.step()

    def values(engine) -> dict:
        with zcore.GatheredParameters(list(engine.module.parameters())):
            return {n: p.detach().clone() for n, p in engine.module.named_parameters()}

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = [tmp]
        dist.broadcast_object_list(path)  # one directory for every rank
        engine, *_ = zcore.initialize(model=make_model("gpt"), config=config)
        train(engine, range(3))
        engine.save_checkpoint(path[0], tag="three")
        train(engine, range(3, 5))
        values(engine)  # every group gathered over the world: secondaries of step 5's values
        out["held before the load"] = engine.gather_stats().secondary_bytes
        engine.load_checkpoint(path[0], tag="three")
        train(engine, range(3, 6))
        out["loaded"] = values(engine)
        weight = engine.module.blocks[0].c_attn.weight
        with zcore.GatheredParameters([weight], modifier_rank=0):
            if rank == 0:
                weight.data.zero_()
        with zcore.GatheredParameters([weight]):
            out["written back"] = weight.detach().abs().max().item()
        engine.destroy()
        dist.barrier()  # the directory outlives every rank's load
    fresh, *_ = zcore.initialize(model=make_model("gpt"), config=config)
    train(fresh, range(6))
    out["fresh"] = values(fresh)
    fresh.destroy()
    return out


def run_all(rank: int, world: int) -> dict:
    counting_group.init_process_group()  # gloo underneath: the exact runs count too, unread
    out = {}
    for label, model, keys in EXACT:
        config = zcore_config(3, 2, 0.0, zero=keys, train_batch_size=BATCH)
        out[label] = train_zcore(rank, world, model, config, STEPS, inspect=secondaries)
    for label, keys in COUNTED:
        out[label] = counted_steps(rank, keys)
    out["checkpoint"] = checkpoint_and_write_back(rank)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(run_all, WORLD, timeout=300)


def test_hpz_matches_single_process_adamw(results):
    for label, model, _ in EXACT:
        ref = train_reference(model, 0.0, STEPS, WORLD, 2, batch=BATCH)
        assert_matches(results[0][label], ref, TOLERANCE, label)
        for rank, out in enumerate(results):
            stats = out[label]["gather_stats"]
            assert stats.secondary_gathers > 0, (label, rank)  # the within-block path ran
            assert stats.secondary_bytes == 0, (label, rank)  # the last step dropped them all
            # After train_zcore's final GatheredParameters: one secondary per
            # group, counted in the memory report beside the shards.
            held, full_set, counted = out[label]["inspected"]
            assert held == full_set == counted, (label, rank)


def test_later_gathers_stay_within_the_block(results):
    model = make_model("gpt")
    sizes, uses = stage3_layout(model, WORLD)
    P, U, A, c = sum(sizes), sum(uses), 2, 4
    world_share, block_share = Fraction(WORLD - 1, WORLD), Fraction(HPZ - 1, HPZ)
    all_reduce = 2 * world_share * 4 * len(list(model.parameters()))  # used-parameter flags
    want = {
        "hpZ": (world_share * c * P, block_share * c * (2 * A * U - P)),
        "hpZ and qwZ": (
            (WORLD - 1) * sum(quantized_bytes(s // WORLD, WEIGHT_BITS, WEIGHT_BLOCK) for s in sizes),
            # A secondary travels as the WORLD / HPZ primary shards it holds.
            (HPZ - 1) * (WORLD // HPZ) * (
                2 * A * sum(quantized_bytes(s // WORLD, WEIGHT_BITS, WEIGHT_BLOCK) for s in uses)
                - sum(quantized_bytes(s // WORLD, WEIGHT_BITS, WEIGHT_BLOCK) for s in sizes)),
        ),
    }
    for label, _ in COUNTED:
        world_send, block_send = want[label]
        for rank, out in enumerate(results):
            sent, _ = out[label]
            for step, (on_world, on_block) in enumerate(sent, start=1):
                where = f"{label}, rank {rank}, step {step}"
                assert on_world == {"send": world_send, "recv": 0, "all_to_all": world_share * 4 * A * P,
                                    "all_reduce": all_reduce}, where
                assert on_block == {"send": block_send, "recv": 0}, where
    # qwZ's secondary gathers give back the codes of the first gather:
    # training goes on alike (the quantization error, zcore's test_zero_quantized).
    plain, quantized = results[0]["hpZ"][1], results[0]["hpZ and qwZ"][1]
    assert quantized == pytest.approx(plain, rel=0.01) and quantized != plain


class SmallBesideLarge(torch.nn.Module):
    """One weight of 6000 elements: rank 0's shard of it near 1e-3, rank
    1's near 10 (both in one secondary of the block of ranks 0 and 1)."""

    def __init__(self) -> None:
        super().__init__()
        w = torch.randn(6000, generator=torch.Generator().manual_seed(0))
        w[:1500] *= 1e-3
        w[1500:3000] *= 10.0
        self.w = torch.nn.Parameter(w)
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(self.w.detach().clone())
        return (x * self.w).sum()


def weights_seen_with_qwz(rank: int, world: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model = SmallBesideLarge()
    true = model.w.detach().clone()
    zero = {**ON_DEMAND, "zero_quantized_weights": True}
    config = {"train_batch_size": 8, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-9}}, "zero_optimization": {"stage": 3, **zero}}
    engine, *_ = zcore.initialize(model=model, config=config)
    for _ in range(2):  # the second micro-step's forward gathers from the secondaries
        engine.backward(engine(torch.ones(6000)))
        engine.step()
    assert engine.gather_stats().secondary_gathers > 0
    engine.destroy()
    return true, model.seen


def test_with_qwz_a_secondary_gives_back_each_shards_own_quantization():
    """The int8 bound per weight, max|x| / 254 over its block of its primary
    shard, holds for the gathers from secondaries as for the first (not the
    bound of a block that runs into a shard of larger weights)."""
    true, seen = run_ranks(weights_seen_with_qwz, WORLD, timeout=300)[0]
    shards = true.view(WORLD, -1)
    for gathered in seen:
        for k, (got, want) in enumerate(zip(gathered.view(WORLD, -1), shards)):
            for start in range(0, want.numel(), WEIGHT_BLOCK):
                block = slice(start, start + WEIGHT_BLOCK)
                bound = want[block].abs().max() / 254 * (1 + 1e-5)
                assert (got[block] - want[block]).abs().max() <= bound, (k, start)


def test_a_checkpoint_load_and_a_write_back_drop_the_secondaries(results):
    for rank, out in enumerate(results):
        ckpt = out["checkpoint"]
        assert ckpt["held before the load"] > 0, rank
        for name, value in ckpt["fresh"].items():
            assert torch.equal(ckpt["loaded"][name], value), (rank, name)
        assert ckpt["written back"] == 0.0, rank


def context(world: int) -> DistributedContext:
    return DistributedContext(rank=0, world_size=world, local_rank=0, device=torch.device("cpu"), backend="gloo")


def hpz_config(size: int, stage: int = 3) -> dict:
    return {"train_batch_size": 8, "zero_optimization": {"stage": stage, "zero_hpz_partition_size": size}}


@pytest.mark.parametrize("world, size, used", [(4, 2, 2), (8, 4, 4), (4, 4, 1), (2, 8, 1), (4, 1, 1), (4, 0, 1)])
def test_blocks_of_the_world_or_larger_need_no_secondary(world, size, used):
    """A block holding every rank gathers over the world already: no
    secondary (``used`` 1), as for 0 and 1."""
    assert policies_from_config(load_config(hpz_config(size)), context(world)).comm.hpz_size == used


def test_a_size_that_does_not_divide_the_world_is_refused():
    with pytest.raises(zcore.ConfigError, match=r"zero_hpz_partition_size = 3 must divide the world size \(4\)"):
        policies_from_config(load_config(hpz_config(3)), context(4))


@pytest.mark.parametrize("stage", [1, 2])
def test_below_stage_3_is_refused(stage):
    with pytest.raises(zcore.ConfigError, match=rf"zero_hpz_partition_size = 2 .*stage is {stage}.*set the stage to 3"):
        zcore.initialize(model=make_model("gpt"), config=hpz_config(2, stage))
