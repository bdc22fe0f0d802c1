"""ZeRO-3 with the user's own saved-tensor hooks around ``engine(x)``:
``torch.autograd.graph.save_on_cpu()`` and a custom pack/unpack pair must be
called (zcore's own hooks used to shadow them) and training must match
single-process torch run under the same hooks."""

from __future__ import annotations

import contextlib

import pytest
import torch

import zcore
from distributed import run_ranks
from models import make_model

STEPS = 4
BATCH = 4


class CountingHooks:
    """Pack stores the tensor scaled by 2 (so a skipped unpack gives wrong
    gradients) and counts calls: all of them, and those of tensors that are
    not (views of) the parameters whose storages are given."""

    def __init__(self, parameter_storages: frozenset[int] = frozenset()) -> None:
        self.parameter_storages = parameter_storages
        self.packed = 0
        self.activations = 0
        self.unpacked = 0

    def pack(self, t: torch.Tensor) -> tuple[str, torch.Tensor]:
        self.packed += 1
        self.activations += t.untyped_storage().data_ptr() not in self.parameter_storages
        return ("mine", t * 2)

    def unpack(self, saved: tuple[str, torch.Tensor]) -> torch.Tensor:
        assert saved[0] == "mine"
        self.unpacked += 1
        return saved[1] / 2

    def context(self) -> contextlib.AbstractContextManager:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def hooks_for(kind: str, params: list[torch.nn.Parameter] = ()) -> CountingHooks | None:
    storages = frozenset(p.untyped_storage().data_ptr() for p in params)
    return CountingHooks(storages) if kind == "custom" else None


def in_hooks(kind: str, hooks: CountingHooks | None) -> contextlib.AbstractContextManager:
    if kind == "save_on_cpu":
        return torch.autograd.graph.save_on_cpu()
    return hooks.context()


def batches(world: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(BATCH * world, 16, generator=g) for _ in range(STEPS)]


def reference(kind: str, world: int) -> tuple[list[float], int]:
    model = make_model("mlp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)  # zcore's (DeepSpeed's) default
    hooks = hooks_for(kind, list(model.parameters()))
    losses = []
    for x in batches(world):
        with in_hooks(kind, hooks):
            loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, (hooks.activations if hooks else 0)


def train_zero3(rank: int, world: int, kind: str) -> tuple[list[float], int, int]:
    config = {
        "train_batch_size": BATCH * world,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = zcore.initialize(model=make_model("mlp"), config=config)
    hooks = hooks_for(kind)
    losses = []
    for x in batches(world):
        mine = x[rank * BATCH : (rank + 1) * BATCH]
        with in_hooks(kind, hooks):
            loss = engine(mine).square().mean()
        engine.backward(loss)
        engine.step()
        t = loss.detach().clone()
        if world > 1:
            torch.distributed.all_reduce(t)
        losses.append(t.item() / world)
    return losses, (hooks.packed if hooks else 0), (hooks.unpacked if hooks else 0)


@pytest.mark.parametrize("kind", ["custom", "save_on_cpu"])
@pytest.mark.parametrize("world", [1, 2])
def test_user_saved_tensor_hooks_compose_with_zero3(kind: str, world: int) -> None:
    expected, activations = reference(kind, world)
    for losses, packed, unpacked in run_ranks(train_zero3, world, kind, timeout=240):
        assert losses == pytest.approx(expected, rel=1e-5, abs=1e-6)
        if kind == "custom":
            # Every activation torch saved, inside the model or after it, reached
            # the user's hooks; parameters and their views stay zcore's.
            assert packed == activations > 0
            assert unpacked == packed
