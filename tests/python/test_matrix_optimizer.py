"""A second whole-matrix optimizer plugs into ZeRO through
zcore.optim.MatrixOptimizer with no change to the engine: a small Shampoo
(left and right preconditioners, each matrix's own, kept by its owner rank),
written here, matches its single-process reference, written apart, over 20
steps at stages 2 and 3 on 1 to 3 ranks; the engine refuses to save its
whole-matrix states, which checkpoints do not hold yet.
"""

from __future__ import annotations

import re

from typing import Any

import pytest
import torch

import zcore
from distributed import run_ranks
from models import forward, global_batch, loss_of, make_model
from test_muon import averaged, batch_of, clip_by_global_norm, is_matrix, one_thread
from training import rows
from zcore.errors import CheckpointError

STEPS = 20
LR, ADAM_LR, EPS = 0.01, 3e-3, 1e-4
CLIP = 0.05


def inverse_fourth_root(matrix: torch.Tensor) -> torch.Tensor:
    """matrix^(-1/4) of a symmetric positive definite fp32 matrix, through
    its eigendecomposition in float64."""
    values, vectors = torch.linalg.eigh(matrix.double())
    return (vectors * values.clamp_min(1e-30).pow(-0.25)) @ vectors.T


class Shampoo(zcore.optim.MatrixOptimizer):
    """Shampoo (Gupta et al., 2018) without grafting or blocking: L += G Gᵀ,
    R += Gᵀ G, update L^(-1/4) G R^(-1/4)."""

    keeps_whole_state = True

    def __init__(self, params: Any, lr: float = LR, eps: float = EPS) -> None:
        super().__init__(params, {"lr": lr, "eps": eps})

    def cost(self, rows: int, cols: int) -> float:
        return rows**3 + cols**3  # two eigendecompositions

    def premix(self, grad: torch.Tensor, state: dict, group: dict) -> torch.Tensor:
        return grad

    def direction(self, matrix: torch.Tensor, state: dict, group: dict) -> torch.Tensor:
        if not state:
            state["left"] = group["eps"] * torch.eye(matrix.shape[0], dtype=torch.float64)
            state["right"] = group["eps"] * torch.eye(matrix.shape[1], dtype=torch.float64)
        g = matrix.double()
        state["left"] += g @ g.T
        state["right"] += g.T @ g
        return (inverse_fourth_root(state["left"]) @ g @ inverse_fourth_root(state["right"])).float()

    def apply_(self, param: torch.Tensor, direction: torch.Tensor, group: dict, shape: torch.Size) -> None:
        param.add_(direction, alpha=-group["lr"])


def reference_shampoo_step(params: list[torch.nn.Parameter], states: dict) -> None:
    """The same rule, one whole parameter at a time, apart from the class."""
    for p in params:
        g = p.grad.reshape(p.shape[0], -1).double()
        left, right = states.setdefault(
            p, (EPS * torch.eye(g.shape[0], dtype=torch.float64), EPS * torch.eye(g.shape[1], dtype=torch.float64))
        )
        left += g @ g.T
        right += g.T @ g
        update = (inverse_fourth_root(left) @ g @ inverse_fourth_root(right)).float()
        p.data.add_(update.view(p.shape), alpha=-LR)


def split(model: torch.nn.Module) -> tuple[list, list]:
    named = list(model.named_parameters())
    return [p for n, p in named if is_matrix(n, p)], [p for n, p in named if not is_matrix(n, p)]


def reference(world: int, gas: int, stage: int) -> dict:
    with one_thread():
        model = make_model("gpt")
        matrices, others = split(model)
        adamw = torch.optim.AdamW(others, lr=ADAM_LR)
        states: dict = {}
        batch = batch_of(world)
        for step in range(STEPS):
            x, y = global_batch("gpt", step, batch)
            parts = {}
            for m in range(gas):
                for r in range(world):
                    part = rows(m * world + r, world * gas, batch)
                    loss = loss_of("gpt", forward("gpt", model, x[part], step, rank=r), y[part])
                    (loss * (1.0 / gas) if gas != 1 else loss).backward()
                    parts[(r, m)] = [p.grad.clone() for p in model.parameters()]
                    model.zero_grad(set_to_none=True)
            for i, p in enumerate(model.parameters()):
                p.grad = averaged([[parts[(r, m)][i] for m in range(gas)] for r in range(world)], stage)
            clip_by_global_norm(list(model.parameters()), CLIP)
            with torch.no_grad():
                reference_shampoo_step(matrices, states)
            adamw.step()
            model.zero_grad(set_to_none=True)
        return {n: p.detach().clone() for n, p in model.named_parameters()}


# (stage, accumulation, optimizer on the host)
SCENARIOS = {1: [(3, 2, True)], 2: [(2, 2, False), (3, 1, True)], 3: [(3, 1, False)]}


def run_world(rank: int, world: int, checkpoints: str) -> dict:
    out = {}
    for stage, gas, host in SCENARIOS[world]:
        config = {
            "train_batch_size": batch_of(world), "gradient_accumulation_steps": gas, "gradient_clipping": CLIP,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000,
                                  "offload_optimizer": {"device": "cpu" if host else "none"}},
        }
        model = make_model("gpt")
        matrices, others = split(model)
        engine, *_ = zcore.initialize(
            model=model, config=config, optimizer=(Shampoo(matrices), torch.optim.AdamW(others, lr=ADAM_LR))
        )
        batch = engine.train_batch_size()
        for step in range(STEPS):
            x, y = global_batch("gpt", step, batch)
            for m in range(gas):
                part = rows(m * world + rank, world * gas, batch)
                engine.backward(loss_of("gpt", forward("gpt", engine, x[part], step, rank), y[part]))
                engine.step()
        try:
            engine.save_checkpoint(checkpoints)
            refused = None
        except CheckpointError as exc:
            refused = str(exc)
        with zcore.GatheredParameters(list(engine.module.parameters())):
            out[(stage, gas, host)] = {
                "params": {n: p.detach().float().clone() for n, p in engine.module.named_parameters()},
                "refused": refused,
            }
        engine.destroy()
    return out


@pytest.mark.parametrize("world", sorted(SCENARIOS))
def test_shampoo_matches_single_process(world, tmp_path):
    results = run_ranks(run_world, world, str(tmp_path), timeout=600)
    for stage, gas, host in SCENARIOS[world]:
        want = reference(world, gas, stage)
        for rank, out in enumerate(results):
            got = out[(stage, gas, host)]
            tag = f"stage {stage} gas {gas} host {host} world {world} rank {rank}"
            for name, value in got["params"].items():
                assert torch.equal(value, want[name]), f"{tag}: {name} off by {(value - want[name]).abs().max()}"
            assert got["refused"] is not None and "Shampoo keeps a state of each whole matrix" in got["refused"], tag


class Momentum(Shampoo):
    """Shampoo on a momentum it keeps per element without declaring it."""

    keeps_whole_state = False

    def premix(self, grad: torch.Tensor, state: dict, group: dict) -> torch.Tensor:
        buf = state.setdefault("momentum", torch.zeros_like(grad))
        return buf.mul_(0.9).add_(grad)


def on_nvme(rank: int, world: int, swap: str, pair: str) -> str:
    model = make_model("gpt")
    matrices, others = split(model)
    elementwise = torch.optim.AdamW(others) if pair == "torch" else zcore.optim.CPUAdamW(others)
    config = {"train_batch_size": 8, "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": swap}}}
    try:
        engine, *_ = zcore.initialize(model=model, config=config, optimizer=(Momentum(matrices), elementwise))
        x, y = global_batch("gpt", 0, 8)
        engine.backward(loss_of("gpt", forward("gpt", engine, x, 0, rank), y))
        engine.step()
    except (zcore.ConfigError, zcore.InvalidStateError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "stepped"


@pytest.mark.parametrize("pair, match", [
    ("torch", "ConfigError: .*'nvme' steps the states on disk with zcore's fused CPU Adam, not AdamW"),
    ("zcore", r"InvalidStateError: Momentum.premix keeps the per-element states \['momentum'\], but its "
              r"state_keys declare \[\]"),
])
def test_what_nvme_cannot_hold_is_refused_naming_it(pair, match, tmp_path):
    (message,) = run_ranks(on_nvme, 1, str(tmp_path), pair, timeout=120)
    assert re.search(match, message), message
