"""MiCS (``mics_shard_size``, ``mics_hierarchical_params_gather``) on world
4 as 2 nodes x 2 ranks: exact against single-process torch AdamW, bytes
per step as the theory says on each process group, checkpoints that
reload at another world size and layout, and what it cannot serve refused.

Bytes per step, counted on the process groups (zcore.comm.counting_group), on
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

qwZ (``zero_quantized_weights``) with the hierarchical gather, shard
groups of s = 4 (the world: both nodes). Each rank quantizes its shard
once, to int8 in blocks of 2048 with scale max|block| / 127
(zcore.comm.quantized_collectives); the two levels carry those bytes
unchanged and every rank decodes all s slices at the end. So the
weights are exactly a flat qwZ gather's over the group, the same on
every rank, each element within half a scale, max|block| / 254, of its
shard's value (fp32 rounding aside: 1e-6 of that). Bytes per step, q(n)
being an int8 slice of n elements on the wire (an fp32 scale per block,
then the codes, padded to 4 bytes), N = 2 nodes of L = 2 ranks:
  across nodes (the ranks with this rank's local index) the gathers send
    (N-1) x 2 x A x sum over uses of q(u / s),
  within the node (L-1) x 2 x A x sum over uses of N x q(u / s),
and nothing but the reduce-scatters and the flags on the world: across
nodes about a quarter of the unquantized (N-1) x 2 x A x c x U / s.

The tolerance against unquantized MiCS, on test_zero_quantized's tied GPT
and learnable sequences (100 steps). Each weight the forward sees is off
by at most 1/254 (0.4%) of its block's largest, by about 1/440 of it in
root mean square (uniform rounding: a scale / sqrt(12)), and the errors
are zero-mean from step to step, so the loss barely moves: measured here,
10-step means within 0.08% of the unquantized run's, the evaluation loss
within 0.05%, the worst single step 0.4%. That is the flat qwZ run's
error exactly (the same weights), so the test allows test_zero_quantized's
1% on 10-step means and on the evaluation loss. A fault in the
quantization goes far beyond it: each slice's codes decoded with the next
rank's scales put the 10-step means 3% behind in the first ten steps and
39% by the last. A fault in the route is shared with the unquantized run
and shows against the flat gather instead (the transpose between the
levels dropped, which swaps ranks 1's and 2's slices, leaves both with
twice the flat run's loss by the end), as does quantizing again at the
second level, as zcore did: the within-node gather re-encoded the decoded
shards in blocks of 2048 that run across shard boundaries, so ranks 0's
and 1's tails decoded with scales from ranks 2's and 3's hundredfold
values (errors up to 42% of their blocks' largest, and 0.75%, twice the
bound, elsewhere), yet training stayed within 1% (the evaluation loss
0.54% off).
"""

from __future__ import annotations

import os
import tempfile
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import zcore
from distributed import run_ranks
from models import forward, global_batch, loss_of, make_model
from test_counting_group import quantized_bytes, stage3_layout
from test_zero_quantized import assert_trains_alike
from test_zero_quantized import train as train_tied_gpt
from training import TIGHT, assert_matches, rows, train_reference, train_zcore, zcore_config
from zcore.comm import counting_group
from zcore.comm.collectives import DistributedContext
from zcore.config.schema import load_config
from zcore.errors import ConfigError
from zcore.comm.hierarchical_gather import hierarchical_gather
from zcore.config.policies import policies_from_config
from zcore.comm.quantized_collectives import WEIGHT_BITS, WEIGHT_BLOCK, weight_gather
from zcore.comm.topology import build_topology

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
# qwZ with shard groups spanning both nodes, gathered across nodes then within.
ACROSS_NODES = {"mics_shard_size": WORLD, "mics_hierarchical_params_gather": True}
QWZ_STEPS = 100  # test_zero_quantized's run: long enough for the loss to halve
# (label, zero_quantized_weights, zero_optimization keys) on the tied GPT.
QWZ_RUNS = [
    ("unquantized", False, ACROSS_NODES),
    ("qwZ, two levels", True, ACROSS_NODES),
    ("qwZ, flat", True, {"mics_shard_size": WORLD}),
]
SHARD = 3000  # elements per rank for one gather: a block of 2048 and a partial one


def shard_numels(engine) -> dict[int, int]:
    return {g.index: g.local_shard.numel() for g in engine.residency.groups}


def mics_groups(engine) -> tuple:
    """The world, the shard group and the replica group."""
    return None, engine.ranks.shard.group, engine.ranks.replicas.group


def gather_levels(engine) -> tuple:
    """The world, this rank's node, and the ranks with its local index on
    every node (the hierarchical gather's two levels)."""
    topology = engine.ranks.topology
    return None, topology.node_local().group, topology.across_nodes_within(WORLD).group


def counted_steps(rank: int, zero: dict, groups=mics_groups) -> list:
    """Per step after the first: what this rank sent on each of ``groups(engine)``,
    and to ranks on the other node."""
    config = zcore_config(3, 2, 0.0, zero={**EACH_USE, **zero}, train_batch_size=BATCH)
    engine, *_ = zcore.initialize(model=make_model("gpt"), config=config)
    counted = groups(engine)
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
        sent.append((*(counting_group.counters(group) for group in counted), across))
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
    out["counted"] = counted_steps(rank, {"mics_shard_size": 2})
    out["checkpoint"] = checkpoints(rank, directory)
    out["qwZ gather"] = qwz_gathers(rank, world)
    out["qwZ counted"] = counted_steps(rank, {**ACROSS_NODES, "zero_quantized_weights": True}, gather_levels)
    out["qwZ"] = {label: train_tied_gpt(rank, 3, weights, False, "fp32", QWZ_STEPS, zero=zero)
                  for label, weights, zero in QWZ_RUNS}
    return out


def shard_values(rank: int) -> torch.Tensor:
    """Rank ``rank``'s shard: normal entries times 10^rank, so that the
    ranks' scales differ a thousandfold."""
    return torch.randn(SHARD, generator=torch.Generator().manual_seed(rank)) * 10.0**rank


def qwz_gathers(rank: int, world: int) -> dict:
    """Every rank's ``shard_values`` gathered with qwZ, across nodes then
    within, and flat over the world."""
    topology = build_topology(None, "cpu")
    two_levels, flat = torch.empty(world * SHARD), torch.empty(world * SHARD)
    gather = hierarchical_gather(True, topology.node_local(), topology.across_nodes_within(world))
    gather(two_levels, shard_values(rank)).wait()
    weight_gather(True, world)(flat, shard_values(rank)).wait()
    return {"two levels": two_levels, "flat": flat}


def block_max(x: torch.Tensor) -> torch.Tensor:
    """Per element, the largest magnitude in its block of WEIGHT_BLOCK (from the start of ``x``)."""
    padded = F.pad(x.abs(), (0, -x.numel() % WEIGHT_BLOCK))
    return padded.view(-1, WEIGHT_BLOCK).amax(dim=1).repeat_interleave(WEIGHT_BLOCK)[: x.numel()]


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


def test_qwz_across_nodes_quantizes_each_shard_once(results):
    """The regression: each level quantized again, so the second re-encoded
    rank 0's tail in a block with rank 2's head, a hundred times larger."""
    exact = torch.cat([shard_values(r) for r in range(WORLD)])
    bound = torch.cat([block_max(shard_values(r)) for r in range(WORLD)]) * (1 / 254 + 1e-6)
    flat = results[0]["qwZ gather"]["flat"]
    for rank, out in enumerate(results):
        two_levels = out["qwZ gather"]["two levels"]
        assert ((two_levels - exact).abs() <= bound).all(), rank  # within half a scale of its own block
        assert torch.equal(two_levels, flat), rank  # the flat gather's values, on every rank
        assert torch.equal(out["qwZ gather"]["flat"], flat), rank


def test_mics_with_qwz_across_nodes_trains_as_unquantized_mics(results):
    runs = results[0]["qwZ"]
    assert_trains_alike(runs["qwZ, two levels"], runs["unquantized"])
    for rank, out in enumerate(results):
        two_levels, flat = out["qwZ"]["qwZ, two levels"], out["qwZ"]["qwZ, flat"]
        assert two_levels["losses"] == flat["losses"], rank  # the same weights, step by step
        for name, value in two_levels["params"].items():
            assert torch.equal(value, flat["params"][name]), (rank, name)
            assert torch.equal(value, runs["qwZ, two levels"]["params"][name]), (rank, name)  # ranks agree


def test_qwz_gathers_cross_nodes_quantized(results):
    s, N, L, A = WORLD, WORLD // LOCAL, LOCAL, 2
    sizes, uses = stage3_layout(make_model("gpt"), s)
    P = sum(sizes)
    n_params = len(list(make_model("gpt").parameters()))
    q = [quantized_bytes(u // s, WEIGHT_BITS, WEIGHT_BLOCK) for u in uses]
    flags = 2 * Fraction(WORLD - 1, WORLD) * 4 * n_params
    want_world = {"all_to_all": Fraction(s - 1, s) * 4 * A * P, "all_reduce": flags}
    want_node = {"send": (L - 1) * 2 * A * N * sum(q), "recv": 0}
    want_across = {"send": (N - 1) * 2 * A * sum(q), "recv": 0}
    for rank, out in enumerate(results):
        for step, (on_world, on_node, on_across, across) in enumerate(out["qwZ counted"], start=1):
            where = f"rank {rank}, step {step}"
            assert on_world == want_world, where
            assert on_node == want_node, where
            assert on_across == want_across, where
            # Across nodes: the int8 gathers, the reduce-scatters' slices for
            # the other node's two ranks (4 x A x P / s each) and the flags' share.
            assert across == want_across["send"] + 2 * Fraction(4 * A * P, s) + 2 * Fraction(2 * 4 * n_params, WORLD)
    plain = (N - 1) * 2 * A * 4 * sum(uses) // s
    assert 3.9 < plain / want_across["send"] < 4, "about a quarter of the unquantized gathers' bytes"


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


def hierarchical_within_a_node(rank: int, world: int, local: int, shard: int) -> str:
    os.environ["LOCAL_WORLD_SIZE"] = str(local)
    dist.init_process_group("gloo")
    config = mics_config(mics_shard_size=shard, mics_hierarchical_params_gather=True)
    try:
        zcore.initialize(model=make_model("gpt"), config=config)
    except ConfigError as exc:
        return str(exc)
    return "accepted"


@pytest.mark.parametrize(("local", "shard", "fix"), [(2, 2, "a multiple of 2 above it"), (4, 4, "one node")])
def test_a_hierarchical_gather_within_one_node_is_refused(local, shard, fix):
    for message in run_ranks(hierarchical_within_a_node, 4, local, shard, timeout=60):
        assert "span several whole nodes" in message and f"mics_shard_size is {shard}" in message
        assert fix in message


def whole_state(rank: int, world: int, directory: str) -> dict:
    engine, *_ = zcore.initialize(
        model=make_model("gpt"), config=zcore_config(3, 1, 0.0, zero={"mics_shard_size": 2}, train_batch_size=8)
    )
    for step in range(2):
        x, y = global_batch("gpt", step, 8)
        part = rows(rank, world, 8)
        engine.backward(loss_of("gpt", forward("gpt", engine, x[part], step, rank), y[part]))
        engine.step()
    full = engine.full_state_dict()
    zcore.save_pretrained(engine, directory)
    with zcore.GatheredParameters(list(engine.module.parameters())):
        gathered = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    engine.destroy()
    return {"full": full, "gathered": gathered}


def test_the_whole_state_dict_and_save_pretrained_gather_from_rank_0s_shard_group(tmp_path):
    """Rank 0's shard group holds every shard; the other group's copies are
    not gathered (a gather over the world had room for half of them)."""
    from safetensors.torch import load_file

    results = run_ranks(whole_state, WORLD, str(tmp_path), timeout=300)
    full, gathered = results[0]["full"], results[0]["gathered"]
    assert all(r["full"] == {} for r in results[1:])
    saved = load_file(tmp_path / "model.safetensors")
    assert full.keys() == gathered.keys() and saved.keys() <= full.keys()  # saved: a tied weight once
    for key, value in gathered.items():
        assert torch.equal(full[key], value), key
        assert key not in saved or torch.equal(saved[key], value), key


def nodes_of_one_rank(rank: int, world: int) -> dict:
    os.environ["LOCAL_WORLD_SIZE"] = "1"  # each rank its own node
    zero = {"mics_shard_size": world, "mics_hierarchical_params_gather": True}
    return train_zcore(rank, world, "gpt", zcore_config(3, 1, 0.0, zero=zero, train_batch_size=8), 5)


def test_a_hierarchical_gather_over_nodes_of_one_rank_matches(tmp_path):
    """Its within-node level has no peer: the gather is the level across nodes."""
    got = run_ranks(nodes_of_one_rank, 2, timeout=300)[0]
    assert_matches(got, train_reference("gpt", 0.0, 5, 2, 1), TOLERANCE, "2 nodes x 1")
