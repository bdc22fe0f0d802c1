"""Muon with ns_method "gram" (zcore.optim.muon.gram_newton_schulz) against
DeepSpeed 0.19.8's own outputs, recorded by data/muon_gram/make_reference.py
(the command is in its docstring) on a tall (64x16), a wide (24x72) and a
square (32x32) fp32 matrix and a 3-D parameter (3x12x40, a batch of three
matrices to DeepSpeed): the iteration, and two Muon steps (lr 0.02, weight
decay 0.1, momentum 0.95).

Against DeepSpeed run eagerly (its functions with torch.compile off, the
operations its source writes, each rounding once) zcore's results are
DeepSpeed's to the bit: the same operations in the same order and dtypes.
Bit-exactness needs this CPU to round an fp16 matmul and an fp32 norm as
the CPU that made the reference did; a probe recorded with the reference
tells, and the bit-exact tests skip, naming it, where it does not.

Against DeepSpeed as it ships (under torch.compile) they agree within a
bound: a direction's error, ‖ours − DeepSpeed's‖ / ‖DeepSpeed's‖ in the
Frobenius norm, at most GRAM_RELATIVE = 1e-2. Measured: 6.9e-3 (tall),
5.8e-3 (wide), 4.6e-3 (square), 5.9e-3 (3-D), the same eager against
compiled inside DeepSpeed. Inductor fuses each chain of fp16 element-wise
operations (b·R + c·R·R, a·Q + Z·Q) into one kernel that computes in fp32
and rounds once, where eager rounds after each operation; fp16's unit
roundoff is 2^-11 ≈ 4.9e-4, and the quintic's slope (a = 3.4445 at 0)
carries the differences of early steps through the later ones: about 13
roundoffs after 5 steps. The bound is above the largest measured, and below
what separates the Gram iteration in fp16 from torch's in bfloat16 on the
same matrices (1.6e-2 to 1.7e-2), the spread Muon already accepts. A
parameter after k steps then differs by at most k · lr · scale ·
GRAM_ABSOLUTE, with GRAM_ABSOLUTE = 5e-3 the direction's largest
element-wise difference (measured 3.4e-3) and scale the step's adjustment
for the shape, sqrt(4) for the tall matrix (measured: 1.3e-4 after step 1
and 1.7e-4 after step 2 on the tall one, against bounds of 2e-4 and 4e-4).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import zcore
from distributed import run_ranks
from zcore.config.schema import load_config
from zcore.errors import InvalidArgumentError
from zcore.optim.muon import NS_METHODS, Muon, gram_newton_schulz

REFERENCE = Path(__file__).parent / "data" / "muon_gram" / "reference.pt"
SHAPES = ("tall", "wide", "square", "batch")
GRAM_RELATIVE = 1e-2
GRAM_ABSOLUTE = 5e-3
STEPS = 2


@pytest.fixture(scope="module")
def ref() -> dict:
    return torch.load(REFERENCE, weights_only=True)


@pytest.fixture(scope="module")
def rounds_as_reference(ref: dict) -> None:
    """Skips where this CPU's fp16 matmul or fp32 norm rounds otherwise."""
    same_matmul = torch.equal(ref["probe/a"] @ ref["probe/b"], ref["probe/product"])
    same_norm = torch.equal(ref["probe/x"].norm(dim=(-2, -1), keepdim=True), ref["probe/norm"])
    if not (same_matmul and same_norm):
        pytest.skip(
            f"this CPU rounds {'an fp16 matmul' if not same_matmul else 'an fp32 norm'} otherwise than the CPU "
            "that made data/muon_gram/reference.pt, so bit-exactness against it cannot be checked here"
        )


def hyper(ref: dict) -> dict:
    return {k: ref[f"hyper/{k}"].item() for k in ("lr", "weight_decay", "momentum")}


def gram_steps(ref: dict) -> dict[str, list[torch.Tensor]]:
    """Each matrix after each of zcore's Muon steps with ns_method "gram"."""
    params = {name: torch.nn.Parameter(ref[f"{name}/param"].clone()) for name in SHAPES}
    optimizer = Muon(list(params.values()), ns_method="gram", **hyper(ref))
    after: dict[str, list[torch.Tensor]] = {name: [] for name in SHAPES}
    for step in range(1, STEPS + 1):
        for name, p in params.items():
            p.grad = ref[f"{name}/grad{step}"].clone()
        optimizer.step()
        for name, p in params.items():
            after[name].append(p.detach().clone())
    return after


def relative(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours.float() - theirs.float()).norm() / theirs.float().norm()).item()


def test_reference_iterated_in_fp16_as_deepspeed_does_on_a_gpu(ref):
    # DeepSpeed falls back to fp32 on a CPU without fp16 matmuls; zcore never does.
    assert ref["compute_dtype"].dtype == torch.float16
    assert ref["ns_steps"].item() == 5


@pytest.mark.parametrize("name", SHAPES)
def test_gram_iteration_is_deepspeeds_eager_to_the_bit(ref, rounds_as_reference, name):
    ours = gram_newton_schulz(ref[f"{name}/grad1"])
    assert ours.dtype == torch.float16
    assert torch.equal(ours, ref[f"{name}/gram/eager"])


@pytest.mark.parametrize("name", SHAPES)
def test_gram_iteration_is_within_the_bound_of_deepspeeds_compiled(ref, name):
    ours, theirs = gram_newton_schulz(ref[f"{name}/grad1"]), ref[f"{name}/gram/compiled"]
    assert relative(ours, theirs) <= GRAM_RELATIVE
    assert (ours.float() - theirs.float()).abs().max().item() <= GRAM_ABSOLUTE


def test_muon_gram_steps_are_deepspeeds_eager_to_the_bit(ref, rounds_as_reference):
    for name, after in gram_steps(ref).items():
        for step, ours in enumerate(after, start=1):
            assert torch.equal(ours, ref[f"{name}/step{step}/eager"]), (name, step)


def test_muon_gram_steps_are_within_the_bound_of_deepspeeds_compiled(ref):
    lr = hyper(ref)["lr"]
    for name, after in gram_steps(ref).items():
        rows, cols = ref[f"{name}/param"].shape[-2:]
        scale = math.sqrt(max(1, rows / cols))
        for step, ours in enumerate(after, start=1):
            difference = (ours - ref[f"{name}/step{step}/compiled"]).abs().max().item()
            assert difference <= step * lr * scale * GRAM_ABSOLUTE, (name, step, difference)


def test_gram_refuses_a_step_scaled_otherwise_than_deepspeeds():
    with pytest.raises(InvalidArgumentError, match="adjust_lr_fn='match_rms_adamw'.*set it to None or 'original'"):
        Muon([torch.nn.Parameter(torch.ones(3, 2))], ns_method="gram", adjust_lr_fn="match_rms_adamw")


def test_muon_refuses_an_unknown_ns_method_naming_the_known_ones():
    with pytest.raises(InvalidArgumentError, match=r"ns_method='cubic' is not one of \('standard', 'gram'\)"):
        Muon([torch.nn.Parameter(torch.ones(3, 2))], ns_method="cubic")


def test_config_takes_each_method_muon_knows():
    for method in NS_METHODS:
        config = {"train_batch_size": 4, "optimizer": {"type": "Muon", "params": {"ns_method": method}}}
        assert load_config(config).optimizer.params.ns_method == method


@pytest.mark.parametrize("value", ["Gram", "quintic", ""])
def test_config_refuses_another_ns_method_naming_the_two(value):
    config = {"train_batch_size": 4, "optimizer": {"type": "Muon", "params": {"ns_method": value}}}
    with pytest.raises(zcore.ConfigError, match="optimizer.params.ns_method.*'standard'.*or 'gram'"):
        load_config(config)


def test_configured_gram_reaches_the_step_the_engine_takes():
    """zcore.initialize builds Muon with the configured method, and its step
    is the single-process Gram Muon's on the same gradient."""
    torch.manual_seed(0)
    model, x = torch.nn.Linear(12, 40), torch.randn(1, 12)
    expected = torch.nn.Parameter(model.weight.detach().clone())
    expected.grad = torch.func.grad(lambda w: (x @ w.T + model.bias.detach()).square().sum())(expected.detach())
    config = {
        "train_batch_size": 1, "gradient_clipping": 0,
        "optimizer": {"type": "Muon", "params": {"lr": 0.02, "weight_decay": 0.1, "ns_method": "gram"}},
    }
    engine, optimizer, *_ = zcore.initialize(model=model, config=config)
    try:
        assert optimizer.inner.matrix.ns_method == "gram"
        engine.backward(engine(x).square().sum())
        engine.step()
        Muon([expected], lr=0.02, weight_decay=0.1, momentum=0.95, ns_method="gram").step()
        assert torch.equal(model.weight.detach(), expected.detach())
    finally:
        engine.destroy()


class Heads(torch.nn.Module):
    """Two matrices and a 3-D parameter (three heads' projections), which
    the Gram iteration takes as a batch of three matrices."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(12, 40, bias=False)
        self.heads = torch.nn.Parameter(torch.randn(3, 40, 8) * 0.1)
        self.out = torch.nn.Linear(24, 6, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.einsum("bd,hde->bhe", self.inp(x), self.heads)
        return self.out(h.flatten(1))


def gram_under_zero(rank: int, world: int, stage: int) -> dict[str, torch.Tensor]:
    """Two Gram Muon steps of the Heads model at ``stage``, every rank on
    the same input (so that the averaged gradient is each rank's, exactly)."""
    torch.manual_seed(0)
    model = Heads()
    config = {
        "train_batch_size": world, "gradient_clipping": 0, "zero_optimization": {"stage": stage},
        "optimizer": {"type": "Muon", "params": {"lr": 0.02, "weight_decay": 0.1, "ns_method": "gram"}},
    }
    engine, *_ = zcore.initialize(model=model, config=config)
    for step in range(STEPS):
        engine.backward(engine(torch.randn(2, 12, generator=torch.Generator().manual_seed(step))).square().sum())
        engine.step()
    with zcore.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return params


@pytest.mark.parametrize("stage", [2, 3])
def test_gram_under_zero_is_the_single_process_step_to_the_bit(stage):
    """Each matrix's owner iterates on the fp32 matrix the others send it
    (a bfloat16 exchange would not give these bits), the 3-D one as a batch."""
    torch.manual_seed(0)
    model = Heads()
    optimizer = Muon(list(model.parameters()), lr=0.02, weight_decay=0.1, momentum=0.95, ns_method="gram")
    for step in range(STEPS):
        optimizer.zero_grad()
        model(torch.randn(2, 12, generator=torch.Generator().manual_seed(step))).square().sum().backward()
        optimizer.step()
    for params in run_ranks(gram_under_zero, 2, stage):
        for name, p in model.named_parameters():
            assert torch.equal(params[name], p.detach()), name
