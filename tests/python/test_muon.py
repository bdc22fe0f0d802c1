"""Muon under ZeRO (zcore.step.matrix_step: owner compute) matches a single
process running torch.optim.Muon on the matrices and torch.optim.AdamW on
the other parameters, DeepSpeed's split, over the same global batches: the
loss at every step and the final parameters within 1e-5 relative over 20
steps, at stages 1, 2 and 3, with accumulation, clipping and bf16, the
optimizer on the device (the CPU here), on the host and on NVMe; configured as
DeepSpeed configures it, or passed as a torch Muon and AdamW over the
user's own split. The bytes each rank sends per step are those of the
formula (note "matrix bytes" in zcore.step.matrix_step), counted by the
counting process group. Checkpoints resume bit-exact and reload at another
world size, from and to states on NVMe too.

One spawn of ranks per world size runs every scenario of that world.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from contextlib import contextmanager
from fractions import Fraction
from typing import Optional

import pytest
import torch

import zcore
from distributed import run_ranks
from models import forward, global_batch, loss_of, make_model
from training import DTYPES, GLOBAL_BATCH, relative_error, rows
from zcore.comm import counting_group
from zcore.errors import InvalidArgumentError
from zcore.optim.muon import Muon
from zcore.step.matrix_step import assign_owners, matrix_cost
from zcore.step.swapped_optimizer import SwappedMaster

STEPS = 20
TOLERANCE = 1e-5
MUON_LR, ADAM_LR, WEIGHT_DECAY, MOMENTUM = 0.02, 3e-3, 0.01, 0.95
BETAS, EPS = (0.9, 0.95), 1e-10
BUCKET = 3000


def batch_of(world: int) -> int:
    """The global batch: GLOBAL_BATCH rows, 12 on 3 ranks."""
    return 12 if world == 3 else GLOBAL_BATCH


def muon_config(
    stage: int, gas: int, clip: float, precision: str = "fp32", tier: str = "none", batch: int = GLOBAL_BATCH,
    swap: Optional[str] = None, **zero,
) -> dict:
    """``tier``: where the optimizer's states live, "none" (the device),
    "cpu" or "nvme" (under ``swap``)."""
    offload = {"device": tier} if tier != "nvme" else {"device": "nvme", "nvme_path": swap}
    config = {
        "train_batch_size": batch,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {"type": "Muon", "params": {
            "muon_lr": MUON_LR, "adam_lr": ADAM_LR, "weight_decay": WEIGHT_DECAY, "momentum": MOMENTUM,
            "betas": list(BETAS), "eps": EPS,
        }},
        "zero_optimization": {
            "stage": stage, "reduce_bucket_size": BUCKET,
            "offload_optimizer": offload, **zero,
        },
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def is_matrix(name: str, p: torch.nn.Parameter) -> bool:
    """DeepSpeed's split, written here apart from zcore's."""
    return p.dim() >= 2 and "embed" not in name and "lm_head" not in name


def reference_optimizers(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    muon = torch.optim.Muon(
        [p for n, p in named if is_matrix(n, p)], lr=MUON_LR, weight_decay=WEIGHT_DECAY, momentum=MOMENTUM
    )
    adamw = torch.optim.AdamW(
        [p for n, p in named if not is_matrix(n, p)], lr=ADAM_LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY
    )
    return muon, adamw


def clip_by_global_norm(params: list[torch.nn.Parameter], max_norm: float) -> None:
    """torch.nn.utils.clip_grad_norm_'s rule, the norm summed in float64 as
    zcore sums it: a last-bit difference in the coefficient, which the order
    of an fp32 sum makes, comes out of Muon's bfloat16 iteration as a visible one."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = math.sqrt(sum(float(torch.linalg.vector_norm(g, dtype=torch.float64) ** 2) for g in grads))
    coefficient = max_norm / (norm + 1e-6)
    if coefficient < 1.0:
        for g in grads:
            g.mul_(coefficient)


@contextmanager
def one_thread() -> Iterator[None]:
    """As the ranks compute (tests/python/distributed.py): with more threads
    some reductions (LayerNorm's parameter gradients) sum in another order."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def train_reference(
    model_name: str, clip: float, steps: int, world: int, gas: int, precision: str, stage: int
) -> dict:
    """One process: the same parts of each global batch, fp32 gradients
    averaged, clipped by their global norm, torch's Muon and AdamW on fp32
    masters (a bf16 copy computes)."""
    with one_thread():
        return _train_reference(model_name, clip, steps, world, gas, precision, stage)


def _train_reference(
    model_name: str, clip: float, steps: int, world: int, gas: int, precision: str, stage: int
) -> dict:
    master = make_model(model_name)
    dtype = DTYPES[precision]
    model = master if dtype == torch.float32 else copy.deepcopy(master).to(dtype)
    pairs = list(zip(master.parameters(), model.parameters()))
    optimizers = reference_optimizers(master)
    losses = []
    for step in range(steps):
        batch = batch_of(world)
        x, y = global_batch(model_name, step, batch)
        total = 0.0
        parts: dict[tuple[int, int], list[torch.Tensor]] = {}
        for m in range(gas):
            for r in range(world):
                part = rows(m * world + r, world * gas, batch)
                loss = loss_of(model_name, forward(model_name, model, x[part], step, rank=r), y[part])
                (loss * (1.0 / gas) if gas != 1 else loss).backward()
                total += loss.item()
                parts[(r, m)] = [cp.grad.float() for _, cp in pairs]
                model.zero_grad(set_to_none=True)
        for i, (mp, _) in enumerate(pairs):
            mp.grad = averaged([[parts[(r, m)][i] for m in range(gas)] for r in range(world)], stage)
        if clip > 0:
            clip_by_global_norm(list(master.parameters()), clip)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        if model is not master:
            with torch.no_grad():
                for mp, cp in pairs:
                    cp.copy_(mp)
        losses.append(total / (world * gas))
    return {"losses": losses, "params": {n: p.detach().float().clone() for n, p in model.named_parameters()}}


def averaged(grads: list[list[torch.Tensor]], stage: int) -> torch.Tensor:
    """The mean of ``grads[rank][micro_step]``, summed in the order ZeRO sums
    them: stage 1 accumulates each rank's micro-steps, then sums over the
    ranks; stages 2 and 3 sum over the ranks every micro-step and accumulate
    that. A float sum in another order differs in its last bits, which
    Muon's bfloat16 iteration turns into differences of 1e-3."""
    world = len(grads)
    if stage == 1:
        local = []
        for rank in grads:
            acc = torch.zeros_like(rank[0])
            for g in rank:
                acc.add_(g)
            local.append(acc)
        return torch.sum(torch.stack(local), dim=0).div_(world)
    total = torch.zeros_like(grads[0][0])
    for m in range(len(grads[0])):
        total.add_(torch.sum(torch.stack([rank[m] for rank in grads]), dim=0), alpha=1.0 / world)
    return total


def user_split(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    """The user's own split, passed to zcore.initialize as a pair."""
    return reference_optimizers(model)


def train(rank: int, world: int, model_name: str, config: dict, steps: int, pair: bool = False,
          count_from: Optional[int] = None) -> dict:
    """Trains on this rank's parts; returns the losses, the final fp32
    parameters and, from step ``count_from`` on, the bytes sent per step."""
    model = make_model(model_name)
    if pair:
        config = {k: v for k, v in config.items() if k != "optimizer"}
        engine, *_ = zcore.initialize(model=model, config=config, optimizer=user_split(model))
    else:
        engine, *_ = zcore.initialize(model=model, config=config)
    gas, batch = engine.gradient_accumulation_steps(), engine.train_batch_size()
    dtype = engine.optimizer.precision.compute_dtype
    losses, sent = [], []
    for step in range(steps):
        counting_group.reset_all()
        x, y = global_batch(model_name, step, batch)
        total = torch.zeros(())
        for m in range(gas):
            part = rows(m * world + rank, world * gas, batch)
            xs = x[part] if model_name == "gpt" else x[part].to(dtype)
            loss = loss_of(model_name, forward(model_name, engine, xs, step, rank), y[part])
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        if count_from is not None and step >= count_from:
            sent.append(counting_group.counters())
        torch.distributed.all_reduce(total)
        losses.append(total.item() / (world * gas))
    with zcore.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    owners = [m.owner for m in engine.optimizer.update.matrix.matrices]
    engine.destroy()
    return {"losses": losses, "params": params, "sent": sent, "owners": owners,
            "optimizer": type(engine.optimizer.inner).__name__}


# (label, model, stage, accumulation, clipping, precision, where the states live, passed as a pair)
SCENARIOS = {
    1: [
        ("stage 1 fp32", "gpt", 1, 2, 0.05, "fp32", "none", False),
        ("stage 3 bf16 host", "gpt", 3, 1, 0.05, "bf16", "cpu", False),
        ("stage 3 bf16 nvme", "gpt", 3, 1, 0.05, "bf16", "nvme", False),
    ],
    2: [
        ("stage 1 fp32 accumulate clip", "gpt", 1, 2, 0.05, "fp32", "none", False),
        ("stage 2 bf16 clip", "gpt", 2, 1, 0.05, "bf16", "none", False),
        ("stage 2 host pair", "gpt", 2, 2, 0.0, "fp32", "cpu", True),
        ("stage 3 fp32 accumulate clip", "gpt", 3, 2, 0.05, "fp32", "none", False),
        ("stage 3 bf16 host", "gpt", 3, 1, 0.0, "bf16", "cpu", False),
        ("stage 3 bf16 nvme", "gpt", 3, 1, 0.0, "bf16", "nvme", False),
        ("stage 2 bf16 nvme accumulate clip", "gpt", 2, 2, 0.05, "bf16", "nvme", False),
    ],
    3: [
        ("stage 2 fp32 clip", "gpt", 2, 1, 0.05, "fp32", "none", False),
        ("stage 3 host pair", "gpt", 3, 2, 0.05, "fp32", "cpu", True),
        ("stage 3 bf16 nvme clip", "gpt", 3, 1, 0.05, "bf16", "nvme", False),
    ],
    4: [
        ("stage 3 bf16 accumulate clip", "gpt", 3, 2, 0.05, "bf16", "none", False),
    ],
}


def run_world(rank: int, world: int, checkpoints: str) -> dict:
    counting_group.init_process_group()
    swap = f"{checkpoints}/swap{world}"
    out = {}
    for label, model, stage, gas, clip, precision, tier, pair in SCENARIOS[world]:
        config = muon_config(stage, gas, clip, precision, tier, batch_of(world), swap=swap)
        out[label] = train(rank, world, model, config, STEPS, pair=pair, count_from=1)
    if world == 2:
        out["checkpoint"] = save_and_resume(rank, world, muon_config(2, 2, 0.05, tier="cpu"), checkpoints, "muon")
        nvme = muon_config(3, 2, 0.05, tier="nvme", swap=swap)
        out["checkpoint nvme"] = save_and_resume(rank, world, nvme, checkpoints, "muon-nvme")
    if world == 3:
        batch = batch_of(world)
        out["reloaded"] = reload(rank, muon_config(3, 1, 0.05, batch=batch), checkpoints, "muon")
        nvme = muon_config(2, 1, 0.05, tier="nvme", batch=batch, swap=swap)
        out["reloaded on nvme"] = reload(rank, nvme, checkpoints, "muon")
        out["reloaded from nvme"] = reload(rank, muon_config(1, 1, 0.05, batch=batch), checkpoints, "muon-nvme")
    return out


# Checkpoints: saved at world 2 after SAVED_AT steps (stage 2 on the host,
# and stage 3 on NVMe), resumed there, reloaded at world 3 (on the device,
# and on NVMe).
SAVED_AT = 10


def train_steps(engine, rank: int, world: int, first: int, last: int) -> None:
    """Steps ``first`` to ``last`` (exclusive) of the tests' GPT on this rank's parts."""
    gas, batch = engine.gradient_accumulation_steps(), engine.train_batch_size()
    for step in range(first, last):
        x, y = global_batch("gpt", step, batch)
        for m in range(gas):
            part = rows(m * world + rank, world * gas, batch)
            engine.backward(loss_of("gpt", forward("gpt", engine, x[part], step, rank), y[part]))
            engine.step()


def _held(engine) -> dict:
    """This rank's fp32 master and Muon momentum, by (parameter name, first
    element); read from the sub-groups where the states are on NVMe."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    optimizer = engine.optimizer
    master = optimizer.master
    on_nvme = isinstance(master, SwappedMaster)
    rows = {(u, k): states.clone() for u, k, states in master.read_pieces()} if on_nvme else {}
    held = {}
    for u, (unit, pieces) in enumerate(zip(optimizer.units, master.pieces)):
        for k, (meta, piece) in enumerate(zip(unit.pieces, pieces)):
            key = (names[id(unit.params[meta.param_index])], meta.param_start)
            state = optimizer.state.get(piece, {})
            if on_nvme:
                momentum = rows[(u, k)][1] if "momentum_buffer" in state else None
                held[key] = (rows[(u, k)][0], momentum)
            else:
                momentum = state.get("momentum_buffer")
                held[key] = (piece.detach().clone(), None if momentum is None else momentum.clone())
    return held


def _parameters(engine) -> dict:
    with zcore.GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def save_and_resume(rank: int, world: int, config: dict, checkpoints: str, tag: str) -> dict:
    engine, *_ = zcore.initialize(model=make_model("gpt"), config=config)
    train_steps(engine, rank, world, 0, SAVED_AT)
    engine.save_checkpoint(checkpoints, tag=tag)
    saved = _held(engine)
    train_steps(engine, rank, world, SAVED_AT, STEPS)
    straight = _parameters(engine)
    engine.destroy()
    engine, *_ = zcore.initialize(model=make_model("gpt"), config=config)
    engine.load_checkpoint(checkpoints, tag=tag)
    train_steps(engine, rank, world, SAVED_AT, STEPS)
    resumed = _parameters(engine)
    engine.destroy()
    return {"saved": saved, "straight": straight, "resumed": resumed}


def reload(rank: int, config: dict, checkpoints: str, tag: str) -> dict:
    engine, *_ = zcore.initialize(model=make_model("gpt"), config=config)
    engine.load_checkpoint(checkpoints, tag=tag)
    held = _held(engine)
    engine.destroy()
    return held


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[int, list[dict]]:
    checkpoints = str(tmp_path_factory.mktemp("muon_checkpoints"))
    return {world: run_ranks(run_world, world, checkpoints, timeout=900) for world in SCENARIOS}


def whole(held_by_rank: list[dict], which: int) -> dict[str, torch.Tensor]:
    """Each parameter's master (``which`` 0) or momentum (1), joined from
    every rank's pieces."""
    parts: dict[str, list] = {}
    for held in held_by_rank:
        for (name, start), values in held.items():
            if values[which] is not None:
                parts.setdefault(name, []).append((start, values[which]))
    return {name: torch.cat([v for _, v in sorted(pieces, key=lambda x: x[0])]) for name, pieces in parts.items()}


@pytest.mark.parametrize("run", ["checkpoint", "checkpoint nvme"])
def test_checkpoints_resume_bit_exact(results, run):
    for out in results[2]:
        got = out[run]
        assert got["resumed"].keys() == got["straight"].keys()
        for name, value in got["resumed"].items():
            assert torch.equal(value, got["straight"][name]), name


@pytest.mark.parametrize("saved_as, loaded_as", [
    ("checkpoint", "reloaded"), ("checkpoint", "reloaded on nvme"), ("checkpoint nvme", "reloaded from nvme"),
])
def test_checkpoints_reload_at_another_world_size(results, saved_as, loaded_as):
    """Saved on 2 ranks (stage 2 on the host, or stage 3 on NVMe), loaded
    on 3 (on the device or on NVMe): every master weight and Muon momentum
    as saved."""
    saved = [out[saved_as]["saved"] for out in results[2]]
    loaded = [out[loaded_as] for out in results[3]]
    for which in (0, 1):
        want, got = whole(saved, which), whole(loaded, which)
        assert got.keys() == want.keys() and want, which
        for name, value in got.items():
            assert torch.equal(value, want[name]), name


@pytest.mark.parametrize("world", sorted(SCENARIOS))
def test_muon_matches_single_process(results, world):
    references: dict = {}
    for label, model, stage, gas, clip, precision, _, pair in SCENARIOS[world]:
        key = (model, gas, clip, precision, min(stage, 2))
        if key not in references:
            references[key] = train_reference(model, clip, STEPS, world, gas, precision, stage)
        ref, got = references[key], results[world][0][label]
        tag = f"{label}, world {world}"
        assert got["optimizer"] == "MatrixAndElementwise", tag
        for step, (a, b) in enumerate(zip(got["losses"], ref["losses"], strict=True)):
            assert abs(a - b) <= TOLERANCE * abs(b), f"{tag}: step {step} loss {a} vs {b}"
        for name, value in got["params"].items():
            err = relative_error(value, ref["params"][name])
            assert err <= TOLERANCE, f"{tag}: {name} off by {err:.2e}"
        for other in results[world][1:]:
            for name, value in other[label]["params"].items():
                assert torch.equal(value, got["params"][name]), tag


@pytest.mark.parametrize("world", [1, 2])
def test_states_on_nvme_step_as_in_host_memory_to_the_bit(results, world):
    """The same training with the states on NVMe (two passes over the
    sub-groups: zcore.step.swapped_matrix) and in host memory."""
    for rank, out in enumerate(results[world]):
        host, nvme = out["stage 3 bf16 host"], out["stage 3 bf16 nvme"]
        assert nvme["losses"] == host["losses"], rank
        for name, value in nvme["params"].items():
            assert torch.equal(value, host["params"][name]), (rank, name)


def matrix_bytes(model_name: str, world: int, owners: list[int], rank: int) -> Fraction:
    """Note "matrix bytes": bf16 elements leaving rank ``rank`` per step,
    from each matrix's ranges (stage 1 and 2 units: parameters packed whole
    in order, the configured split's matrices first, into units of at most
    BUCKET elements, each padded to a multiple of the world and cut in
    equal shards)."""
    units, current = [], []
    for name, p in split_order(make_model(model_name)):
        if current and sum(q.numel() for _, q in current) + p.numel() > BUCKET:
            units.append(current)
            current = []
        current.append((name, p))
    units.append(current)
    total, m = 0, 0
    for unit in units:
        padded = -(-sum(p.numel() for _, p in unit) // world) * world
        shard = padded // world
        offset = 0
        for name, p in unit:
            if is_matrix(name, p):
                held = [max(0, min((r + 1) * shard, offset + p.numel()) - max(r * shard, offset)) for r in range(world)]
                total += p.numel() - held[rank] if owners[m] == rank else held[rank]
                m += 1
            offset += p.numel()
    return Fraction(2 * total)


@pytest.mark.parametrize("world", [2, 3])
def test_bytes_per_step_match_the_formula(results, world):
    """Stage 2 (and, at world 2, stage 1): every step after the first, the
    all-to-all bytes are the matrix exchange's; the reduce-scatter's are
    stage 2's own (tests/python/test_counting_group.py)."""
    label = {2: "stage 2 bf16 clip", 3: "stage 2 fp32 clip"}[world]
    for rank, out in enumerate(results[world]):
        got = out[label]
        want = matrix_bytes("gpt", world, got["owners"], rank)
        model = make_model("gpt")
        units = sum(-(-n // world) * world for n in _unit_sizes(model))
        reduce_scatter = Fraction(world - 1, world) * 4 * units
        for step, sent in enumerate(got["sent"], start=1):
            assert sent["all_to_all"] - reduce_scatter == want, f"world {world} rank {rank} step {step}"
    owners = results[world][0][label]["owners"]
    assert sorted(set(owners)) == list(range(world)), "every rank owns some matrix"


def split_order(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The trained parameters in the order of the configured split's groups: Muon's, then AdamW's."""
    named = list(model.named_parameters())
    return [(n, p) for n, p in named if is_matrix(n, p)] + [(n, p) for n, p in named if not is_matrix(n, p)]


def _unit_sizes(model: torch.nn.Module) -> list[int]:
    sizes, current = [], 0
    for _, p in split_order(model):
        if current and current + p.numel() > BUCKET:
            sizes.append(current)
            current = 0
        current += p.numel()
    return sizes + [current]


class _Named(torch.nn.Module):
    """Two matrices DeepSpeed's rule sends apart (an embedding, a hidden
    matrix) and a vector."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Parameter(torch.randn(8, 4))
        self.hidden = torch.nn.Parameter(torch.randn(4, 4))
        self.scale = torch.nn.Parameter(torch.ones(4))


def _muon_half(model: torch.nn.Module) -> list[str]:
    from zcore.config.schema import load_config
    from zcore.step.optimizers import collect_param_groups

    config = load_config(muon_config(2, 1, 0.0))
    split = collect_param_groups(model, None, None, config.optimizer)
    names = {id(p): n for n, p in model.named_parameters()}
    return sorted(names[id(p)] for g in split.groups[: split.matrix_groups] for p in g["params"])


def test_a_use_muon_attribute_set_by_the_user_decides_the_split():
    model = _Named()
    assert _muon_half(model) == ["hidden"]  # DeepSpeed's rule: 2-D, and no "embed" in the name
    model.embed_tokens.use_muon = True
    model.hidden.use_muon = False
    assert _muon_half(model) == ["embed_tokens"]
    model.scale.use_muon = True  # Muon takes matrices only: refused, naming the shape
    with pytest.raises(InvalidArgumentError, match=r"shape \(4,\) has fewer than 2 dimensions"):
        _muon_half(model)


def test_owners_balance_the_iterations_multiply_adds():
    """A 64 x 4096 matrix costs the standard iteration 5(2·64²·4096 + 64³)
    multiply-adds, more than a 170 x 170 one (5·3·170³), but the Gram one
    only 4·64²·4096 + 20·64³, less: on 3 ranks, beside a 512 x 512 matrix
    that takes the first, the costlier of the two goes to the second rank."""
    shapes = [(64, 4096), (170, 170), (512, 512)]
    standard = Muon([torch.nn.Parameter(torch.zeros(1, 1))])
    gram = Muon([torch.nn.Parameter(torch.zeros(1, 1))], ns_method="gram")
    assert standard.cost(64, 4096) == 5 * (2 * 64 * 64 * 4096 + 64**3)
    assert gram.cost(4096, 64) == 4 * 64 * 64 * 4096 + 20 * 64**3
    assert gram.cost(170, 170) == standard.cost(170, 170) == 15 * 170**3
    assert assign_owners([standard.cost(*s) for s in shapes], 3) == [1, 2, 0]
    assert assign_owners([gram.cost(*s) for s in shapes], 3) == [2, 1, 0]
    # A 3-D parameter is a batch of matrices to "gram", one matrix to "standard".
    heads = torch.Size([8, 512, 512])
    assert matrix_cost(gram, heads) == 8 * gram.cost(512, 512)
    assert matrix_cost(standard, heads) == standard.cost(8, 512 * 512)
