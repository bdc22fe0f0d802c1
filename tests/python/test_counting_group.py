"""zcore.comm.counting_group counts what each operation sends, and zcore's
stages 2 and 3 send what the theory says.

Primitives, on 2 and 3 ranks: every operation zcore issues runs on the
counting default group and on a plain gloo group side by side, with the same
results; the counts match figures worked out by hand from the conventions in
zcore.comm.counting_group's docstring. Subgroups count on their own.

The theory, on TinyGPT (26 parameter tensors, a tied embedding and LM head)
at world W = 2, 3 and 4 (3 pads groups). c: bytes per compute element (fp32
4, bf16 2); r: per reduced element (4: fp32 unless communication_data_type);
A: micro-steps per step; pad(n): n rounded up to a multiple of W. On gloo,
zcore's all-gather is point-to-point sends and its reduce-scatter an
all-to-all (zcore.comm.collectives), which count the same bytes as an all-gather and a
reduce-scatter would. Per step:

Stage 3. Groups: each module's own parameters (a tied one goes with the first
module that has it), P = sum of pad(group). One reduce-scatter per group per
micro-step:  all_to_all = (W-1)/W x r x A x P.  All-gathers:
  send = (W-1)/W x c x A x (elements gathered per micro-step), which is
  - on demand (stage3_max_live_parameters 0, stage3_max_reuse_distance 0:
    each use gathers its groups and releases them at its exit):
    2 x (sum over uses of its groups' sizes), forward and backward; every
    module with parameters runs once, and the LM head uses the embedding's
    group, so 2 x (P + pad(wte));
  - with an ample budget (the defaults; A = 1): P, each group staying gathered
    from its forward use to its backward use; end_step releases them all.
Stage 2. Units: the trainable parameters in order, packed whole into at most
reduce_bucket_size elements (a larger one alone), U = sum of pad(unit):
  all_to_all = (W-1)/W x r x A x U;  send = (W-1)/W x c x U (the updated
  shards, gathered once per step).
Both: all_reduce = 2 (W-1)/W x (4 x 26 + 8): the used-parameter flags (int32
per parameter tensor) and, with gradient_clipping > 0, the squared gradient
norm (float64). The first step records zcore's trace and checks that ranks
agree at every use (more all-reduces); the steps after it are counted.
"""

from __future__ import annotations

import pickle
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

import zcore
from distributed import run_ranks
from models import forward, global_batch, loss_of, make_model
from training import rows, zcore_config
from zcore.comm import counting_group
from zcore.comm.quantized_collectives import GRADIENT_BITS, GRADIENT_BLOCK, WEIGHT_BITS, WEIGHT_BLOCK


# Primitives.

# The names the installed torch offers (torch before 2.13 has only the
# *_tensor ones), as zcore.comm.collectives picks them.
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _run_primitives(rank: int, n: int, group) -> dict:
    """Each operation zcore uses, on ``group``; what every one produced."""
    out = {}
    received = {p: torch.empty(5) for p in range(n) if p != rank}
    ops = []
    for p, buf in received.items():
        ops.append(dist.P2POp(dist.isend, torch.full((5,), float(rank)), p, group))
        ops.append(dist.P2POp(dist.irecv, buf, p, group))
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    out["p2p"] = [received[p] for p in sorted(received)]
    out["a2a"] = torch.empty(2 * n)
    dist.all_to_all_single(out["a2a"], torch.arange(2.0 * n) + 100 * rank, group=group)
    # Uneven: rank r sends j + 1 rows of 3 to rank j.
    send = torch.arange(n * (n + 1) // 2 * 3.0).view(-1, 3) + 1000 * rank
    out["a2a uneven"] = torch.empty((rank + 1) * n, 3)
    dist.all_to_all_single(out["a2a uneven"], send, [rank + 1] * n, [j + 1 for j in range(n)], group=group)
    out["gather single"] = torch.empty(3 * n, dtype=torch.float64)
    mine = torch.tensor([rank, rank + 0.5, -rank], dtype=torch.float64)
    ALL_GATHER(out["gather single"], mine, group=group)
    out["gather list"] = [torch.empty(4, dtype=torch.bfloat16) for _ in range(n)]
    dist.all_gather(out["gather list"], torch.full((4,), rank + 1.0, dtype=torch.bfloat16), group=group)
    out["reduce-scatter"] = torch.empty(2)
    REDUCE_SCATTER(out["reduce-scatter"], torch.arange(2.0 * n) * (rank + 1), group=group)
    out["sum"] = torch.arange(6.0) * (rank + 1)
    dist.all_reduce(out["sum"], group=group)
    out["max"] = torch.tensor([rank, -rank, 7], dtype=torch.int32)
    dist.all_reduce(out["max"], op=dist.ReduceOp.MAX, group=group)
    out["broadcast"] = torch.full((7,), float(rank))
    dist.broadcast(out["broadcast"], src=1, group=group)
    out["objects"] = [None] * n
    dist.all_gather_object(out["objects"], f"rank{rank}", group=group)
    out["gather"] = [torch.empty(2) for _ in range(n)] if rank == 0 else None
    dist.gather(torch.full((2,), float(rank)), out["gather"], dst=0, group=group)
    dist.barrier(group=group)
    return {k: _as_lists(v) for k, v in out.items()}


def _as_lists(value):
    """Tensors, and lists of them, as lists: to compare and to send back."""
    if torch.is_tensor(value):
        return value.tolist()
    if isinstance(value, list):
        return [_as_lists(v) for v in value]
    return value


def primitives(rank: int, n: int) -> tuple:
    counting_group.init_process_group()
    plain = dist.new_group(list(range(n)), backend="gloo")
    counted = _run_primitives(rank, n, None)
    return (counted, _run_primitives(rank, n, plain), counting_group.counters(), counting_group.calls(),
            counting_group.peer_bytes())


def expected_primitives(rank: int, n: int) -> tuple[dict, dict]:
    """Bytes and calls by kind, by hand from the conventions."""
    obj = len(pickle.dumps(f"rank{rank}"))  # all_gather_object: one int64 size, then the pickle
    sent = {
        "send": 20 * (n - 1),  # 5 float32 to each peer
        "recv": 0,
        "all_to_all": 8 * (n - 1) + 12 * (n * (n + 1) // 2 - (rank + 1)),  # all but its own slice(s)
        "all_gather": (24 + 8 + 8 + obj) * (n - 1),  # 3 float64, 4 bf16, the object: to every other rank
        "reduce_scatter": 8 * (n - 1),  # (n-1)/n of 2n float32
        "all_reduce": Fraction(2 * (n - 1), n) * (24 + 12),  # 6 float32, 3 int32
        "broadcast": 28 * (n - 1) if rank == 1 else 0,  # 7 float32 from the root
        "gather": 8 if rank != 0 else 0,  # 2 float32 to rank 0
        "barrier": 0,
    }
    calls = {"send": n - 1, "recv": n - 1, "all_to_all": 2, "all_gather": 4, "reduce_scatter": 1,
             "all_reduce": 2, "broadcast": 1, "gather": 1, "barrier": 1}
    return sent, calls


@pytest.mark.parametrize("n", [2, 3])
def test_primitives_count_what_they_send(n):
    for rank, (counted, plain, sent, calls, to_peer) in enumerate(run_ranks(primitives, n, timeout=60)):
        assert counted == plain, f"rank {rank}: results differ from plain gloo"
        assert (sent, calls) == expected_primitives(rank, n), f"rank {rank}"
        assert sum(to_peer.values()) == sum(sent.values()) and rank not in to_peer, f"rank {rank}"
        # Each peer gets the same share of most operations: p2p 20, all-to-all
        # 8, the gathers 24 + 8 + (8 + the pickle), reduce-scatter 8,
        # all-reduces 2 x 36 / n; the uneven all-to-all j + 1 rows of 3
        # float32 to rank j; the broadcast from rank 1, the gather to rank 0.
        even = 20 + 8 + 24 + 8 + 8 + len(pickle.dumps(f"rank{rank}")) + 8 + Fraction(72, n)
        for peer, got in to_peer.items():
            want = even + 12 * (peer + 1) + (28 if rank == 1 else 0) + (8 if peer == 0 else 0)
            assert got == want, f"rank {rank} to {peer}"


def subgroups(rank: int, n: int) -> dict:
    counting_group.init_process_group()
    pair = dist.new_group([1, 2], backend=counting_group.BACKEND)
    plain = dist.new_group(list(range(n)), backend="gloo")
    out = {}
    if rank in (1, 2):
        dist.all_reduce(torch.ones(4), group=pair)
        dist.broadcast(torch.ones(3), src=2, group=pair)  # rank 2 is the pair's root
        out["pair"] = counting_group.counters(pair)
    dist.all_reduce(torch.ones(2))
    out["world"] = counting_group.counters()
    try:
        counting_group.counters(plain)
    except ValueError as exc:
        out["plain"] = str(exc)
    return out


def test_subgroups_count_apart():
    results = run_ranks(subgroups, 3, timeout=60)
    for rank, out in enumerate(results):
        assert out["world"] == {"all_reduce": Fraction(2 * 2, 3) * 8}, rank
        assert "does not count bytes" in out["plain"]
    assert "pair" not in results[0]
    assert results[1]["pair"] == {"all_reduce": 16, "broadcast": 0}
    assert results[2]["pair"] == {"all_reduce": 16, "broadcast": 12}


# The theory for zcore's stages.

ON_DEMAND = {"stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 0,
             "stage3_max_reuse_distance": 0}
AMPLE = {"stage3_param_persistence_threshold": 0}
QUANTIZED = {**ON_DEMAND, "zero_quantized_weights": True, "zero_quantized_gradients": True}
BUCKET = 3000  # training.zcore_config's reduce_bucket_size
CLIP = 1.0
STEPS = 3  # the first records the trace and is not counted
# (label, stage, precision, micro-steps, zero_optimization keys)
VARIANTS = [
    ("stage 3 fp32 on demand", 3, "fp32", 1, ON_DEMAND),
    ("stage 3 bf16 on demand, 2 micro-steps", 3, "bf16", 2, ON_DEMAND),
    ("stage 3 fp32 ample budget", 3, "fp32", 1, AMPLE),
    ("stage 2 bf16, 2 micro-steps", 2, "bf16", 2, {}),
    # ZeRO++ (zcore.comm.quantized_collectives): the same gathers and reductions, quantized.
    ("stage 3 bf16 on demand, qwZ and qgZ", 3, "bf16", 2, QUANTIZED),
    ("stage 3 fp32 on demand, qwZ and qgZ", 3, "fp32", 1, QUANTIZED),
]


def train_counting(rank: int, world: int) -> dict:
    """Per variant, the bytes this rank sent in each counted step."""
    counting_group.init_process_group()
    out = {}
    for label, stage, precision, gas, keys in VARIANTS:
        batch = 2 * world * gas
        config = zcore_config(stage, gas, CLIP, precision=precision, zero=keys, train_batch_size=batch)
        engine, _, _, _ = zcore.initialize(model=make_model("gpt"), config=config)
        steps = []
        for step in range(STEPS):
            counting_group.reset()
            x, y = global_batch("gpt", step, batch)
            for m in range(gas):
                part = rows(m * world + rank, world * gas, batch)
                engine.backward(loss_of("gpt", forward("gpt", engine, x[part], step, rank), y[part]))
                engine.step()
            steps.append(counting_group.counters())
        engine.destroy()
        out[label] = steps[1:]
    return out


def pad(numel: int, world: int) -> int:
    return -(-numel // world) * world


def stage3_layout(model: torch.nn.Module, world: int) -> tuple[list[int], list[int]]:
    """Padded group sizes, and per use (module with parameters, run once per
    forward) the size of each group it needs."""
    group_of: dict[int, int] = {}
    sizes: list[int] = []
    uses: list[int] = []
    for module in model.modules():
        direct = list(module.parameters(recurse=False))
        own = [p for p in direct if id(p) not in group_of]
        if own:
            sizes.append(pad(sum(p.numel() for p in own), world))
            group_of.update((id(p), len(sizes) - 1) for p in own)
        uses += [sizes[g] for g in dict.fromkeys(group_of[id(p)] for p in direct)]
    return sizes, uses


def stage2_units(model: torch.nn.Module, world: int) -> list[int]:
    units, current = [], 0
    for p in model.parameters():
        if current and current + p.numel() > BUCKET:
            units.append(pad(current, world))
            current = 0
        current += p.numel()
    return units + [pad(current, world)]


def quantized_bytes(numel: int, bits: int, block: int) -> int:
    """One rank's quantized slice on the wire: an fp32 scale per block, then
    the codes (a byte each for int8, two to a byte for int4), padded to 4 bytes."""
    codes = numel if bits == 8 else -(-numel // 2)
    return -(-(4 * -(-numel // block) + codes) // 4) * 4


def theory(stage: int, precision: str, gas: int, keys: dict, world: int) -> dict:
    model = make_model("gpt")
    c, r = (2 if precision == "bf16" else 4), 4
    share = Fraction(world - 1, world)
    all_reduce = 2 * share * (4 * len(list(model.parameters())) + 8)
    if keys == QUANTIZED:
        # Each gather sends this rank's int8 slice to every other rank; each
        # reduce-scatter sends every other rank its int4 slice of the bucket.
        sizes, uses = stage3_layout(model, world)
        weights = sum(quantized_bytes(s // world, WEIGHT_BITS, WEIGHT_BLOCK) for s in uses)
        grads = sum(quantized_bytes(s // world, GRADIENT_BITS, GRADIENT_BLOCK) for s in sizes)
        return {"send": (world - 1) * gas * 2 * weights, "recv": 0, "all_to_all": (world - 1) * gas * grads,
                "all_reduce": all_reduce}
    if stage == 3:
        sizes, uses = stage3_layout(model, world)
        gathered = 2 * sum(uses) if keys == ON_DEMAND else sum(sizes)
        return {"send": share * c * gas * gathered, "recv": 0, "all_to_all": share * r * gas * sum(sizes),
                "all_reduce": all_reduce}
    units = sum(stage2_units(model, world))
    return {"send": share * c * units, "recv": 0, "all_to_all": share * r * gas * units, "all_reduce": all_reduce}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_bytes_per_step_match_theory(world):
    results = run_ranks(train_counting, world, timeout=120)
    for label, stage, precision, gas, keys in VARIANTS:
        want = theory(stage, precision, gas, keys, world)
        for rank, out in enumerate(results):
            for step, got in enumerate(out[label], start=1):
                assert got == want, f"{label}, world {world}, rank {rank}, step {step}"
    # The yardstick: qwZ sends half the all-gather bytes of bf16,
    # qgZ about a seventh of the fp32 reduce-scatter's.
    plain, quantized = results[0]["stage 3 bf16 on demand, 2 micro-steps"][0], \
        results[0]["stage 3 bf16 on demand, qwZ and qgZ"][0]
    assert 0.5 <= quantized["send"] / plain["send"] <= 0.51
    assert 0.14 <= quantized["all_to_all"] / plain["all_to_all"] <= 0.15
