"""ZeRO-3 leaf modules (DeepSpeed's set_z3_leaf_modules): a mixture of
experts whose ranks route their tokens to different experts trains at
stage 3 exactly as one process does, once its MoE blocks are leaves; without
the mark, zcore stops at once with its divergence error, naming the fix.

DeepSpeed's own test of this (tests/unit/runtime/zero/test_zero_leaf_module.py)
runs a model whose rank picks the layer it runs; here each rank's tokens
reach only its own experts, through a learned gate, in two MoE blocks: one
whose inputs take no gradient (the raw features) and one whose inputs do.
The helpers themselves are checked as DeepSpeed's unit tests check them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zcore
from distributed import run_ranks

TIMEOUT = 240  # the harness kills the ranks and fails past this
FEATURES, HIDDEN, CLASSES, EXPERTS = 12, 16, 5, 4
STEPS, GAS, MICRO = 4, 2, 3  # micro-batch rows per rank
# Adam's eps well above the gradients' rounding: with torch's 1e-8, an
# element whose gradient cancels to ~1e-8 turns summation-order rounding
# into a visible update difference.
LR, WEIGHT_DECAY, EPS = 1e-2, 0.01, 1e-4


class Expert(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


class MoEBlock(nn.Module):
    """Top-1 routing where the expert of each token is given (rank-dependent)
    and the gate weighs it; an expert that no token reaches does not run,
    as in Hugging Face's MoE blocks."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gate = nn.Linear(width, EXPERTS, bias=False)
        self.experts = nn.ModuleList(Expert(width) for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor, expert_of: torch.Tensor) -> torch.Tensor:
        weight = torch.softmax(self.gate(x), dim=-1).gather(1, expert_of[:, None])
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = (expert_of == e).nonzero().flatten()
            if rows.numel():
                out = out.index_add(0, rows, weight[rows] * expert(x[rows]))
        return out


class MoEModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = MoEBlock(FEATURES)  # its inputs take no gradient
        self.proj = nn.Linear(FEATURES, HIDDEN)
        self.second = MoEBlock(HIDDEN)
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor, expert_of: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.proj(x + self.first(x, expert_of)))
        return self.head(h + self.second(h, expert_of))


def make_model() -> MoEModel:
    torch.manual_seed(0)
    return MoEModel()


def batch(step: int, part: int, world: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Part ``part`` (rank part % world) of step ``step``: its tokens go to
    the experts of its rank only (rank r: experts r, r + world, ...), and in
    odd steps to the first of them only, so some experts get no token anywhere."""
    g = torch.Generator().manual_seed(1000 * step + part)
    x = torch.randn(MICRO, FEATURES, generator=g)
    y = torch.randint(0, CLASSES, (MICRO,), generator=g)
    rank = part % world
    mine = torch.arange(rank, EXPERTS, world)
    if step % 2:
        mine = mine[:1]
    expert_of = mine[torch.randint(0, len(mine), (MICRO,), generator=g)]
    return x, expert_of, y


def config(world: int, zero: dict | None = None) -> dict:
    return {
        "train_batch_size": MICRO * GAS * world,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY, "eps": EPS}},
        # Every group gathered on demand and released at once: the case where
        # ranks' gathers and reductions must match one for one.
        "zero_optimization": {
            "stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0, **(zero or {}),
        },
    }


def train_leaf_moe(rank: int, world: int, by_config: bool = False) -> dict:
    """Marked by set_z3_leaf_modules, or (``by_config``) by the config's
    zero_optimization.leaf_module section, as DeepSpeed reads it."""
    model = make_model()
    if by_config:
        section = {"classes": f"{MoEBlock.__module__}.{MoEBlock.__qualname__}"}  # a string: a list of one
        engine, *_ = zcore.initialize(model=model, config=config(world, {"leaf_module": section}))
        marked = zcore.get_z3_leaf_modules(model)
    else:
        marked = zcore.set_z3_leaf_modules(model, [MoEBlock])
        engine, *_ = zcore.initialize(model=model, config=config(world))
    losses = []
    for step in range(STEPS):
        total = torch.zeros(())
        for m in range(GAS):
            x, expert_of, y = batch(step, m * world + rank, world)
            loss = nn.functional.cross_entropy(engine(x, expert_of), y)
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        dist.all_reduce(total)
        losses.append(total.item() / (world * GAS))
    with zcore.GatheredParameters(list(model.parameters())):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.destroy()
    return {"marked": [type(m).__name__ for m in marked], "losses": losses, "params": params}


def unmarked_moe(rank: int, world: int) -> str:
    """The same model without the mark: what zcore does at the first step."""
    engine, *_ = zcore.initialize(model=make_model(), config=config(world))
    x, expert_of, y = batch(0, rank, world)
    try:
        engine.backward(nn.functional.cross_entropy(engine(x, expert_of), y))
    except zcore.InvalidStateError as failure:
        return str(failure)
    finally:
        engine.destroy()
    return "trained through"


def leaf_then_unmarked(rank: int, world: int) -> dict:
    return {
        "leaf": train_leaf_moe(rank, world),
        "by_config": train_leaf_moe(rank, world, by_config=True),
        "unmarked": unmarked_moe(rank, world),
    }


def train_reference(world: int) -> dict:
    """One process, the whole global batch, torch's AdamW."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, eps=EPS)
    parts = world * GAS
    losses = []
    for step in range(STEPS):
        total = 0.0
        for q in range(parts):
            x, expert_of, y = batch(step, q, world)
            loss = nn.functional.cross_entropy(model(x, expert_of), y)
            (loss / parts).backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total / parts)
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_routing_to_different_experts_train_exactly_as_one_process(world):
    results = run_ranks(leaf_then_unmarked, world, timeout=TIMEOUT)
    ref = train_reference(world)
    for rank, got in enumerate(results):
        for how in ("leaf", "by_config"):
            leaf = got[how]
            assert leaf["marked"] == ["MoEBlock", "MoEBlock"], how
            for step, (a, b) in enumerate(zip(leaf["losses"], ref["losses"], strict=True)):
                assert abs(a - b) <= 1e-6, f"{how}, rank {rank} step {step}: loss {a} vs {b}"
            for name, value in ref["params"].items():
                err = (leaf["params"][name] - value).abs().max().item()
                assert err <= 1e-6, f"{how}, rank {rank}: {name} off by {err:.2e}"
        unmarked = got["unmarked"]
        assert "ranks diverged" in unmarked, unmarked
        assert "module 'first.experts.0.up' (Linear)" in unmarked, unmarked
        assert "zcore.set_z3_leaf_modules" in unmarked, unmarked


class Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.child = Child()
        self.other = nn.Linear(2, 2)


class BaseLeaf(nn.Module):
    pass


class Child(BaseLeaf):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(2, 2)


def test_helpers_mark_by_class_name_and_suffix_as_deepspeed_does():
    model = Wrapper()
    assert zcore.get_z3_leaf_modules(model) == []
    # A base class marks its subclasses' instances; the fully qualified name and the bare name work too.
    assert zcore.set_z3_leaf_modules(model, [BaseLeaf]) == [model.child]
    assert zcore.z3_leaf_module(model.child) and not zcore.z3_leaf_module(model)
    assert zcore.unset_z3_leaf_modules(model, ["Child"]) == [model.child]
    assert zcore.get_z3_leaf_modules(model) == []
    assert zcore.set_z3_leaf_modules(model, [f"{Child.__module__}.{Child.__qualname__}"]) == [model.child]
    assert zcore.zero.z3_leaf_parameter(model.child.proj.weight)
    assert not zcore.zero.z3_leaf_parameter(model.other.weight)
    zcore.unset_z3_leaf_modules(model, [Child])
    assert zcore.zero.set_z3_leaf_modules_by_name(model, ["other", "missing"], raise_if_not_found=False) == (
        [model.other], ["missing"]
    )
    assert zcore.zero.set_z3_leaf_modules_by_suffix(model, ["ther", "nothing"], flag=False, raise_if_not_found=False) == (
        [model.other], ["nothing"]
    )
    assert zcore.get_z3_leaf_modules(model) == []
    with pytest.raises(zcore.InvalidArgumentError, match="no modules of the classes") as raised:
        zcore.set_z3_leaf_modules(model, [nn.Conv2d])
    assert isinstance(raised.value, ValueError)  # what DeepSpeed raises
    assert zcore.set_z3_leaf_modules(model, ["Conv2d"], raise_if_not_found=False) == []
    with pytest.raises(zcore.InvalidArgumentError, match="module classes or class names"):
        zcore.set_z3_leaf_modules(model, [3])
    with pytest.raises(zcore.InvalidArgumentError, match=r"no modules named \['missing'\]"):
        zcore.zero.set_z3_leaf_modules_by_name(model, ["missing"])


def test_the_config_section_reads_what_deepspeed_reads():
    zero = zcore.config.load_config({"train_batch_size": 1, "zero_optimization": {"stage": 3}}).zero_optimization
    # DeepSpeed 0.19.8's defaults: the sparse MoE blocks of Mixtral, Qwen2-MoE and Qwen3-MoE.
    assert zero.leaf_module.classes == [
        "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
        "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
        "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
    ]
    assert zero.leaf_module.names == [] and zero.leaf_module.name_suffixes == []
    section = {"classes": "my.Class", "names": ["a.b", "a.b"], "name_suffixes": "tail"}
    zero = zcore.config.load_config(
        {"train_batch_size": 1, "zero_optimization": {"stage": 3, "leaf_module": section}}
    ).zero_optimization
    assert (zero.leaf_module.classes, zero.leaf_module.names, zero.leaf_module.name_suffixes) == (
        ["my.Class"], ["a.b"], ["tail"]
    )
    with pytest.raises(zcore.ConfigError, match="leaf_module"):
        zcore.config.load_config(
            {"train_batch_size": 1, "zero_optimization": {"stage": 3, "leaf_module": {"clases": ["X"]}}}
        )
