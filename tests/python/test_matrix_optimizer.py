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
from test_muon import averaged, batch_of, clip_by_global_norm, is_matrix, one_thread, train_steps
from training import rows

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
SAVED_AT = 10


def config_of(world: int, stage: int, gas: int, host: bool) -> dict:
    return {
        "train_batch_size": batch_of(world), "gradient_accumulation_steps": gas, "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000,
                              "offload_optimizer": {"device": "cpu" if host else "none"}},
    }


def shampoo_engine(config: dict):
    model = make_model("gpt")
    matrices, others = split(model)
    engine, *_ = zcore.initialize(
        model=model, config=config, optimizer=(Shampoo(matrices), torch.optim.AdamW(others, lr=ADAM_LR))
    )
    return engine


def parameters(engine) -> dict:
    with zcore.GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def whole_states(engine) -> dict:
    """The preconditioners this rank keeps, by parameter name."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    step = engine.optimizer.update.matrix
    units = engine.optimizer.units
    return {
        names[id(units[m.unit].params[m.param_index])]: {k: v.clone() for k, v in step.whole_states[m.index].items()}
        for m in step.matrices if m.index in step.whole_states
    }


def run_world(rank: int, world: int, checkpoints: str) -> dict:
    """Each scenario 20 steps, saved after SAVED_AT; the first resumed from
    there; at world 3, world 2's first checkpoint loaded."""
    out = {}
    for i, (stage, gas, host) in enumerate(SCENARIOS[world]):
        config = config_of(world, stage, gas, host)
        engine = shampoo_engine(config)
        train_steps(engine, rank, world, 0, SAVED_AT)
        tag = f"w{world}s{stage}"
        engine.save_checkpoint(checkpoints, tag=tag)
        saved = whole_states(engine)
        train_steps(engine, rank, world, SAVED_AT, STEPS)
        out[(stage, gas, host)] = {"params": parameters(engine), "saved": saved}
        engine.destroy()
        if i == 0:
            engine = shampoo_engine(config)
            engine.load_checkpoint(checkpoints, tag=tag)
            train_steps(engine, rank, world, SAVED_AT, STEPS)
            out["resumed"] = parameters(engine)
            engine.destroy()
    if world == 3:
        engine = shampoo_engine(config_of(world, 3, 1, False))
        engine.load_checkpoint(checkpoints, tag="w2s2")
        out["reloaded"] = whole_states(engine)
        engine.destroy()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    checkpoints = str(tmp_path_factory.mktemp("shampoo"))
    return {world: run_ranks(run_world, world, checkpoints, timeout=600) for world in sorted(SCENARIOS)}


@pytest.mark.parametrize("world", sorted(SCENARIOS))
def test_shampoo_matches_single_process(results, world):
    for stage, gas, host in SCENARIOS[world]:
        want = reference(world, gas, stage)
        for rank, out in enumerate(results[world]):
            got = out[(stage, gas, host)]
            tag = f"stage {stage} gas {gas} host {host} world {world} rank {rank}"
            for name, value in got["params"].items():
                assert torch.equal(value, want[name]), f"{tag}: {name} off by {(value - want[name]).abs().max()}"


@pytest.mark.parametrize("world", sorted(SCENARIOS))
def test_shampoo_checkpoints_resume_bit_exact(results, world):
    """The preconditioners are in the checkpoint: without them the resumed
    steps would start from eps·I and differ."""
    first = SCENARIOS[world][0]
    for out in results[world]:
        for name, value in out["resumed"].items():
            assert torch.equal(value, out[first]["params"][name]), name


def test_shampoo_preconditioners_reload_at_another_world_size(results):
    """Saved by their owners on 2 ranks at stage 2, read by theirs on 3 at stage 3."""
    def joined(parts: list[dict]) -> dict:
        out: dict = {}
        for part in parts:
            assert not out.keys() & part.keys(), "a matrix has one owner"
            out.update(part)
        return out

    saved = joined([out[(2, 2, False)]["saved"] for out in results[2]])
    loaded = joined([out["reloaded"] for out in results[3]])
    assert loaded.keys() == saved.keys() and saved
    for name, states in loaded.items():
        assert states.keys() == {"left", "right"}
        for key, value in states.items():
            assert torch.equal(value, saved[name][key]), (name, key)


class Momentum(Shampoo):
    """Shampoo on a momentum it keeps per element without declaring it."""

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


class CountingShampoo(Shampoo):
    """Shampoo that counts its steps in a Python int."""

    def direction(self, matrix: torch.Tensor, state: dict, group: dict) -> torch.Tensor:
        direction = super().direction(matrix, state, group)
        state["count"] = state.get("count", 0) + 1
        return direction


def save_with_a_count(rank: int, world: int, checkpoints: str) -> str:
    model = make_model("gpt")
    matrices, others = split(model)
    config = {"train_batch_size": 8, "zero_optimization": {"stage": 2}}
    engine, *_ = zcore.initialize(
        model=model, config=config, optimizer=(CountingShampoo(matrices), torch.optim.AdamW(others))
    )
    train_steps(engine, rank, world, 0, 1)
    try:
        engine.save_checkpoint(checkpoints)
    except zcore.CheckpointError as exc:
        return str(exc)
    return "saved"


def test_a_whole_matrix_state_that_is_not_a_tensor_is_refused_on_every_rank(tmp_path):
    for message in run_ranks(save_with_a_count, 2, str(tmp_path), timeout=120):
        assert "keeps a whole-matrix state that is not a tensor" in message, message
        assert "a count as a 0-d tensor" in message
