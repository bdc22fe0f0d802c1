"""CPUAdam / CPUAdamW against torch.optim.Adam / AdamW, on every SIMD level
this CPU supports.

Tolerance: the kernels compute in fp32 with torch's operation order; the one
operation that differs is sqrt (zcore's is correctly rounded, torch's CPU
build uses MKL's, which is not always), so results differ by a few ulps.
Parameters are compared element-wise with rtol=1e-6 and an absolute
tolerance of 1e-6 times the tensor's largest magnitude (an element that
crosses zero keeps the absolute difference it had at its former magnitude).
"""

from __future__ import annotations

import copy
import functools
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import zcore
import zcore.optim as zo
from optim_fixtures import isa  # noqa: F401 (a fixture)

ONE_MILLION_AND_THREE = (1 << 20) + 3


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    atol = 1e-6 * float(expected.abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=atol)


def train(
    cls: type, sizes: tuple[int, ...], steps: int, seed: int, hyper: tuple
) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    """``steps`` steps of ``cls`` on random parameters and gradients drawn
    from ``seed``: the same numbers for every optimizer class."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=gen).requires_grad_() for n in sizes]
    opt = cls(params, **dict(hyper))
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return params, opt


# torch's step is slow here (its sqrt is, on this CPU, for small inputs), and
# every SIMD level compares against the same reference run.
reference = functools.lru_cache(maxsize=None)(train)


def run_both(
    sizes: list[int], steps: int, torch_cls: type, zcore_cls: type, seed: int = 0, **hyper: object
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.optim.Optimizer, torch.optim.Optimizer]:
    frozen = tuple(sorted(hyper.items()))
    ref, ref_opt = reference(torch_cls, tuple(sizes), steps, seed, frozen)
    ours, our_opt = train(zcore_cls, tuple(sizes), steps, seed, frozen)
    return ref, ours, ref_opt, our_opt


@pytest.mark.parametrize("n", [1, 7, 4099])
def test_adamw_1000_steps_flat_match_torch(isa: str, n: int) -> None:
    ref, ours, ref_opt, our_opt = run_both([n], 1000, torch.optim.AdamW, zo.CPUAdamW, lr=1e-3, weight_decay=0.01)
    assert_close(ours[0].detach(), ref[0].detach())
    assert_close(our_opt.state[ours[0]]["exp_avg"], ref_opt.state[ref[0]]["exp_avg"])
    assert_close(our_opt.state[ours[0]]["exp_avg_sq"], ref_opt.state[ref[0]]["exp_avg_sq"])
    assert our_opt.state[ours[0]]["step"].item() == 1000.0


def test_adamw_one_million_and_three_matches_torch(isa: str) -> None:
    # 30 steps: 1000 steps of torch's reference on 1M elements take minutes here.
    ref, ours, _, _ = run_both([ONE_MILLION_AND_THREE], 30, torch.optim.AdamW, zo.CPUAdamW, lr=1e-3)
    assert_close(ours[0].detach(), ref[0].detach())


def test_many_small_tensors_1000_steps_match_torch() -> None:
    sizes = [1, 7, 16, 17, 33, 100, 255, 1000, 4099, 3, 1, 64]
    ref, ours, _, _ = run_both(sizes, 1000, torch.optim.AdamW, zo.CPUAdamW, lr=2e-3, weight_decay=0.1)
    for a, b in zip(ref, ours):
        assert_close(b.detach(), a.detach())


@pytest.mark.parametrize(
    "hyper",
    [
        dict(lr=1e-2, weight_decay=0.05),
        dict(lr=1e-3, betas=(0.8, 0.99), eps=1e-6, maximize=True),
        dict(lr=1e-3, betas=(0.3, 0.9), weight_decay=0.0),  # torch's other lerp formula
    ],
)
def test_adam_with_l2_decay_and_options_match_torch(isa: str, hyper: dict) -> None:
    ref, ours, _, _ = run_both([7, 1000], 300, torch.optim.Adam, zo.CPUAdam, **hyper)
    for a, b in zip(ref, ours):
        assert_close(b.detach(), a.detach())


def test_adamw_with_param_groups_and_a_parameter_without_grad() -> None:
    gen = torch.Generator().manual_seed(3)
    start = [torch.randn(50, generator=gen) for _ in range(3)]
    ref = [p.clone().requires_grad_() for p in start]
    ours = [p.clone().requires_grad_() for p in start]

    def groups(ps):
        return [{"params": ps[:2], "lr": 1e-2}, {"params": ps[2:], "weight_decay": 0.5}]

    ref_opt = torch.optim.AdamW(groups(ref), lr=1e-3)
    our_opt = zo.CPUAdamW(groups(ours), lr=1e-3)
    for step in range(40):
        for i, (a, b) in enumerate(zip(ref, ours)):
            # parameter 1 gets no gradient every third step: its step count lags
            if i == 1 and step % 3 == 0:
                a.grad = b.grad = None
                continue
            g = torch.randn(50, generator=gen)
            a.grad, b.grad = g.clone(), g
        ref_opt.step()
        our_opt.step()
    for a, b in zip(ref, ours):
        assert_close(b.detach(), a.detach())
        assert our_opt.state[b]["step"].item() == ref_opt.state[a]["step"].item()


def test_state_dict_moves_between_torch_and_zcore() -> None:
    ref, ours, ref_opt, our_opt = run_both([33, 7], 5, torch.optim.AdamW, zo.CPUAdamW, lr=1e-2)
    saved = our_opt.state_dict()
    assert set(saved["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert set(saved["param_groups"][0]) == set(ref_opt.state_dict()["param_groups"][0])

    # zcore -> torch and torch -> zcore, then both continue identically. (A
    # loaded state shares tensors with its source dict, as in torch: copy.)
    params_a = [p.detach().clone().requires_grad_() for p in ours]
    params_b = [p.detach().clone().requires_grad_() for p in ours]
    torch_opt = torch.optim.AdamW(params_a, lr=1e-2)
    torch_opt.load_state_dict(copy.deepcopy(saved))
    zcore_opt = zo.CPUAdamW(params_b, lr=1e-2)
    zcore_opt.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    gen = torch.Generator().manual_seed(9)
    for _ in range(5):
        for a, b in zip(params_a, params_b):
            g = torch.randn(a.shape, generator=gen)
            a.grad, b.grad = g.clone(), g
        torch_opt.step()
        zcore_opt.step()
    for a, b in zip(params_a, params_b):
        assert_close(b.detach(), a.detach())
    assert zcore_opt.state[params_b[0]]["step"].item() == 10.0


def test_closure_and_hooks_work_as_in_torch() -> None:
    def train(cls: type) -> tuple[list[float], list[str]]:
        w = torch.zeros(3, requires_grad=True)
        opt = cls([w], lr=0.1)
        calls: list[str] = []
        opt.register_step_pre_hook(lambda *_: calls.append("pre"))
        opt.register_step_post_hook(lambda *_: calls.append("post"))

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = ((w - torch.tensor([1.0, -2.0, 3.0])) ** 2).sum()
            loss.backward()
            return loss.detach()

        return [float(opt.step(closure)) for _ in range(50)], calls

    ours, our_calls = train(zo.CPUAdam)
    ref, ref_calls = train(torch.optim.Adam)
    assert ours == pytest.approx(ref, rel=1e-5)
    assert ours[-1] < ours[0] / 4
    assert our_calls == ref_calls == ["pre", "post"] * 50


def test_constructor_rejects_what_torch_rejects_and_amsgrad() -> None:
    p = [torch.zeros(2, requires_grad=True)]
    for kwargs in (dict(lr=-1.0), dict(betas=(1.0, 0.9)), dict(eps=-1.0), dict(weight_decay=-0.1)):
        with pytest.raises(ValueError):
            torch.optim.Adam(p, **kwargs)
        with pytest.raises(zcore.InvalidArgumentError):
            zo.CPUAdam(p, **kwargs)
    with pytest.raises(zcore.InvalidArgumentError, match="amsgrad"):
        zo.CPUAdamW(p, amsgrad=True)


def test_unsupported_parameters_are_rejected_before_any_update() -> None:
    good = torch.ones(4, requires_grad=True)
    bad = torch.ones(4, 4).t().requires_grad_()  # not contiguous
    good.grad = torch.ones(4)
    bad.grad = torch.ones(4, 4).t()
    opt = zo.CPUAdamW([good, bad])
    with pytest.raises(zcore.InvalidArgumentError, match="not contiguous"):
        opt.step()
    assert torch.equal(good.detach(), torch.ones(4))
    assert len(opt.state) == 1 and opt.state[good]["step"].item() == 0.0

    half = torch.ones(4, dtype=torch.float16, requires_grad=True)
    half.grad = torch.ones(4, dtype=torch.float16)
    with pytest.raises(zcore.InvalidArgumentError, match="dtype=torch.float16"):
        zo.CPUAdamW([half]).step()


def test_isa_can_be_forced_by_environment_variable() -> None:
    script = textwrap.dedent(
        """
        import os
        import zcore, zcore.optim as zo
        try:
            zo.cpu_isa()
        except zcore.InvalidArgumentError as e:
            print("rejected:", e.isa)
        os.environ["ZCORE_CPU_ISA"] = "scalar"
        print("active:", zo.cpu_isa())
        """
    )
    env = dict(os.environ, ZCORE_CPU_ISA="sse9")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["rejected: sse9", "active: scalar"], out.stdout + out.stderr


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_bf16_master_weights_step_in_fp32_and_round_once(isa: str, state_dtype: torch.dtype) -> None:
    """DeepSpeed's bf16 master weights (and bf16 states): torch's fp32 AdamW
    on the upcast values, the weights (and moments) rounded to bf16 after
    every step."""
    gen = torch.Generator().manual_seed(7)
    start = torch.randn(4099, generator=gen).bfloat16()
    ours = start.clone().requires_grad_()
    opt = zo.CPUAdamW([ours], lr=1e-2, weight_decay=0.1, state_dtype=state_dtype)
    ref = start.float().requires_grad_()
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1)
    for _ in range(20):
        grad = torch.randn(4099, generator=gen).bfloat16()  # torch takes gradients of the parameter's dtype
        ours.grad, ref.grad = grad, grad.float()
        opt.step()
        ref_opt.step()
        with torch.no_grad():
            ref.copy_(ref.bfloat16().float())
            if state_dtype == torch.bfloat16:
                for key in ("exp_avg", "exp_avg_sq"):
                    ref_opt.state[ref][key].copy_(ref_opt.state[ref][key].bfloat16().float())
    assert ours.dtype == torch.bfloat16 and opt.state[ours]["exp_avg"].dtype == state_dtype
    # torch's sqrt may differ by an ulp in fp32, which can move a bf16 rounding by one step.
    torch.testing.assert_close(ours.detach().float(), ref.detach(), rtol=2**-7, atol=0.0)
    assert (ours.detach().float() == ref.detach()).float().mean() > 0.99
    torch.testing.assert_close(opt.state[ours]["exp_avg_sq"].float(), ref_opt.state[ref]["exp_avg_sq"], rtol=2**-7, atol=0.0)


def test_fp32_moments_of_bf16_weights_survive_a_state_dict_round_trip() -> None:
    """torch's load_state_dict casts floating states to the parameter's
    dtype; CPUAdam keeps its state_dtype's values."""
    p = torch.randn(64).bfloat16().requires_grad_()
    opt = zo.CPUAdamW([p], state_dtype=torch.float32)
    p.grad = torch.randn(64).bfloat16()
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    q = p.detach().clone().requires_grad_()
    again = zo.CPUAdamW([q], state_dtype=torch.float32)
    again.load_state_dict(saved)
    for key in ("exp_avg", "exp_avg_sq"):
        assert again.state[q][key].dtype == torch.float32
        assert torch.equal(again.state[q][key], saved["state"][0][key])
    with pytest.raises(zcore.InvalidArgumentError, match="state_dtype"):
        zo.CPUAdam([q], state_dtype=torch.float16)
