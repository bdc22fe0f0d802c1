"""MiCS (``mics_shard_size``, ``mics_hierarchical_params_gather``) on world
4 as 2 nodes x 2 ranks: exact against single-process torch AdamW, bytes
per step as the theory says on each process group, checkpoints that
reload at another world size and layout, and what it cannot serve refused.

Bytes per step, counted on the process groups (zcore.counting_group), on
TinyGPT with every use gathering its groups and releasing them at its exit
(as test_zero_hpz). W = 4 ranks, shard groups of s = 2
consecutive ranks (a node), replica groups of r = W / s = 2 ranks holding
the same shard; c = 4 bytes per fp32 element, A = 2 micro-steps; P: the
groups' sizes padded to a multiple of s, summed; U: per use, its groups'
sizes summed. Within the shard group, plain stage 3 over s ranks:
  all-gathers send      (s-1)/s x c x 2 x A x U    (forward and backward),
  reduce-scatters send  (s-1)/s x 4 x A x P        (an all-to-all on gloo);
across replicas, once per step (at the accumulation boundary, not every
micro-step) an all-reduce of each rank's fp32 gradient shard:
  2 x (r-1)/r x 4 x P / s;
on the world, only the used-parameter flags (an all-reduce, as plain
stage 3). The gradient norm is summed within the shard group. So across
nodes go only the replica all-reduce and the flags.
"""

from __future__ import annotations

import os
import tempfile
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

import zcore
from distributed import run_ranks
from models import forward, global_batch, loss_of, make_model
from test_counting_group import stage3_layout
from training import TIGHT, assert_matches, rows, train_reference, train_zcore, zcore_config
from zcore import counting_group
from zcore.comm import DistributedContext
from zcore.config import load_config
from zcore.errors import ConfigError
from zcore.policies import policies_from_config

WORLD, LOCAL, STEPS, TOLERANCE = 4, 2, 20, 1e-5
BATCH = 16  # world x accumulation 2 x 2 rows
ON_DEMAND = {"stage3_param_persistence_threshold": 0}
# Every use gathers its groups and releases them at its exit.
EACH_USE = {**ON_DEMAND, "stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0}
# (label, model, gradient clipping, zero_optimization keys): accumulation 2, fp32.
EXACT = [
    ("shard groups of 2", "gpt", 0.0, {**ON_DEMAND, "mics_shard_size": 2}),
    ("shard groups of 2, tight budget, checkpointing, clipping", "gpt_checkpointed", 0.5,
     {**TIGHT, "mics_shard_size": 2}),
    ("shard groups of 4 gathered across nodes then within", "gpt", 0.0,
     {**ON_DEMAND, "mics_shard_size": 4, "mics_hierarchical_params_gather": True}),
    ("shard groups of 1", "gpt", 0.0, {"mics_shard_size": 1}),
]
NVME = ("shard groups of 2, optimizer states and gradients on NVMe", "gpt", 0.0, {**ON_DEMAND, "mics_shard_size": 2})


def shard_numels(engine) -> dict[int, int]:
    return {g.index: g.local_shard.numel() for g in engine.residency.groups}


def counted_steps(rank: int) -> list:
    """Per step after the first: what this rank sent on the world, its shard
    group and its replica group, and to ranks on the other node."""
    config = zcore_config(3, 2, 0.0, zero={**EACH_USE, "mics_shard_size": 2}, train_batch_size=BATCH)
    engine, *_ = zcore.initialize(model=make_model("gpt"), config=config)
    shard, replicas = engine.ranks.shard.group, engine.ranks.replicas.group
    sent = []
    for step in range(3):
        counting_group.reset_all()
        x, y = global_batch("gpt", step, BATCH)
        for m in range(2):
            part = rows(m * WORLD + rank, WORLD * 2, BATCH)
            engine.backward(loss_of("gpt", forward("gpt", engine, x[part], step, rank), y[part]))
            engine.step()
        to_peer = counting_group.peer_bytes_on_every_group()
        across = sum(b for peer, b in to_peer.items() if peer // LOCAL != rank // LOCAL)
        sent.append((*(counting_group.counters(group) for group in (None, shard, replicas)), across))
    engine.destroy()
    return sent[1:]


def train(engine, rank: int, steps) -> None:
    for step in steps:
        x, y = global_batch("gpt", step, 8)
        part = rows(rank, dist.get_world_size(), 8)
        engine.backward(loss_of("gpt", forward("gpt", engine, x[part], step, rank), y[part]))
        engine.step()


def values(engine) -> dict:
    with zcore.GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def checkpoint_config(zero: dict) -> dict:
    return zcore_config(3, 1, 0.0, zero={**ON_DEMAND, **zero}, train_batch_size=8)


def checkpoints(rank: int, directory: str) -> dict:
    """Train 3 steps with MiCS and save; train 2 more, load: the 3 steps
    after the load must be those of a run that never left the checkpoint."""
    config = checkpoint_config({"mics_shard_size": 2})
    out = {}
    engine, *_ = zcore.initialize(model=make_model("gpt"), config=config)
    train(engine, rank, range(3))
    engine.save_checkpoint(directory, tag="mics")
    out["saved"] = values(engine)
    train(engine, rank, range(3, 5))
    engine.load_checkpoint(directory, tag="mics")
    train(engine, rank, range(3, 6))
    out["resumed"] = values(engine)
    engine.destroy()
    fresh, *_ = zcore.initialize(model=make_model("gpt"), config=config)
    train(fresh, rank, range(6))
    out["fresh"] = values(fresh)
    fresh.destroy()
    return out


def run_all(rank: int, world: int, directory: str) -> dict:
    os.environ["LOCAL_WORLD_SIZE"] = str(LOCAL)  # 2 nodes x 2 ranks
    counting_group.init_process_group()
    out = {}
    for label, model, clip, keys in EXACT:
        config = zcore_config(3, 2, clip, zero=keys, train_batch_size=BATCH)
        out[label] = train_zcore(rank, world, model, config, STEPS, inspect=shard_numels)
    label, model, clip, keys = NVME
    with tempfile.TemporaryDirectory() as tmp:
        nvme = {**keys, "offload_optimizer": {"device": "nvme", "nvme_path": tmp}}
        out[label] = train_zcore(rank, world, model, zcore_config(3, 2, clip, zero=nvme, train_batch_size=BATCH), 5)
    out["counted"] = counted_steps(rank)
    out["checkpoint"] = checkpoints(rank, directory)
    return out


def load_elsewhere(rank: int, world: int, directory: str, zero: dict) -> dict:
    """The MiCS checkpoint loaded by another world size and layout."""
    engine, *_ = zcore.initialize(model=make_model("gpt"), config=checkpoint_config(zero))
    engine.load_checkpoint(directory, tag="mics")
    loaded = values(engine)
    engine.destroy()
    return loaded


@pytest.fixture(scope="module")
def checkpoint_dir():
    with tempfile.TemporaryDirectory() as tmp:
        yield tmp


@pytest.fixture(scope="module")
def results(checkpoint_dir) -> list[dict]:
    return run_ranks(run_all, WORLD, checkpoint_dir, timeout=400)


def test_mics_matches_single_process_adamw(results):
    for label, model, clip, _ in EXACT:
        ref = train_reference(model, clip, STEPS, WORLD, 2, batch=BATCH)
        assert_matches(results[0][label], ref, TOLERANCE, label)
        for rank, out in enumerate(results):
            for name, value in out[label]["params"].items():
                assert torch.equal(value, results[0][label]["params"][name]), (label, rank, name)
    # Each rank holds 1/s of every group: its share of its shard group's.
    sizes, _ = stage3_layout(make_model("gpt"), 2)
    for rank, out in enumerate(results):
        assert sorted(out["shard groups of 2"]["inspected"].values()) == sorted(s // 2 for s in sizes), rank


def test_mics_with_states_on_nvme_matches(results):
    label, model, clip, _ = NVME
    ref = train_reference(model, clip, 5, WORLD, 2, batch=BATCH)
    assert results[0][label]["update"] == "SwappedAdamUpdate"
    assert_matches(results[0][label], ref, TOLERANCE, label)


def test_bytes_per_step_on_each_group(results):
    s, r, c, A = 2, WORLD // 2, 4, 2
    sizes, uses = stage3_layout(make_model("gpt"), s)
    P, U = sum(sizes), sum(uses)
    n_params = len(list(make_model("gpt").parameters()))
    world_share = Fraction(WORLD - 1, WORLD)
    want_world = {"all_reduce": 2 * world_share * 4 * n_params}
    want_shard = {"send": Fraction(s - 1, s) * c * 2 * A * U, "recv": 0,
                  "all_to_all": Fraction(s - 1, s) * 4 * A * P}
    want_replicas = {"all_reduce": 2 * Fraction(r - 1, r) * 4 * P // s}
    for rank, out in enumerate(results):
        for step, (on_world, on_shard, on_replicas, across) in enumerate(out["counted"], start=1):
            where = f"rank {rank}, step {step}"
            assert on_world == want_world, where
            assert on_shard == want_shard, where
            assert on_replicas == want_replicas, where
            # Nothing but the replica all-reduce and the flags' share for the
            # two ranks of the other node crosses nodes.
            assert across == want_replicas["all_reduce"] + 2 * Fraction(2 * 4 * n_params, WORLD), where


def test_a_mics_checkpoint_resumes_and_reloads_at_other_layouts(results, checkpoint_dir):
    for rank, out in enumerate(results):
        ckpt = out["checkpoint"]
        for name, value in ckpt["fresh"].items():
            assert torch.equal(ckpt["resumed"][name], value), (rank, name)
    saved = results[0]["checkpoint"]["saved"]
    for loaded in run_ranks(load_elsewhere, 2, checkpoint_dir, {}, timeout=120):  # plain stage 3, world 2
        for name, value in saved.items():
            assert torch.equal(loaded[name], value), name


def context(world: int) -> DistributedContext:
    return DistributedContext(rank=0, world_size=world, local_rank=0, device=torch.device("cpu"), backend="gloo")


def mics_config(stage: int = 3, **zero) -> dict:
    return {"train_batch_size": 8, "optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": stage, **zero}}


@pytest.mark.parametrize(
    "keys, named",
    [
        ({"stage": 2, "mics_shard_size": 2}, "zero_optimization.stage is 2"),
        ({"mics_shard_size": 0}, "mics_shard_size = 0"),
        ({"mics_hierarchical_params_gather": True}, "mics_shard_size is -1"),
        ({"mics_shard_size": 2, "zero_hpz_partition_size": 2}, "keep one"),
    ],
)
def test_combinations_that_cannot_work_are_refused(keys, named):
    with pytest.raises(ConfigError, match=named):
        load_config(mics_config(**keys))


def test_a_size_that_does_not_divide_the_world_is_refused():
    with pytest.raises(ConfigError, match="must divide the world size"):
        policies_from_config(load_config(mics_config(mics_shard_size=3)), context(4))
    assert policies_from_config(load_config(mics_config(mics_shard_size=2)), context(4)).stage.shard_size == 2
    assert policies_from_config(load_config(mics_config()), context(4)).stage.shard_size == 4


def hierarchical_within_a_node(rank: int, world: int) -> str:
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    dist.init_process_group("gloo")
    config = mics_config(mics_shard_size=2, mics_hierarchical_params_gather=True)
    try:
        zcore.initialize(model=make_model("gpt"), config=config)
    except ConfigError as exc:
        return str(exc)
    return "accepted"


def test_a_hierarchical_gather_within_one_node_is_refused():
    for message in run_ranks(hierarchical_within_a_node, 4, timeout=60):
        assert "span several whole nodes" in message and "mics_shard_size is 2" in message
