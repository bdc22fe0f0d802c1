"""The flat-buffer entry points the offload path calls: mixed-precision Adam
with fused copy-out, gradient scaling, and unscale/overflow/norm; and their
refusal of bad input before any byte is written."""

from __future__ import annotations

import pytest
import torch

import zcore
import zcore.optim as zo
from optim_fixtures import isa  # noqa: F401 (a fixture)

ONE_MILLION_AND_THREE = (1 << 20) + 3
HALF_DTYPES = [torch.bfloat16, torch.float16]


def flat_state(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n, generator=gen),
        torch.randn(n, generator=gen) * 0.1,
        torch.rand(n, generator=gen) * 0.01,
    )


ADAMW = zo.AdamConfig(lr=1e-3, weight_decay=0.01, decoupled_weight_decay=True)


# ------------------------------------------------------- mixed precision --

@pytest.mark.parametrize("out_dtype", HALF_DTYPES)
@pytest.mark.parametrize("grad_dtype", [torch.float32, *HALF_DTYPES])
@pytest.mark.parametrize("n", [1, 7, ONE_MILLION_AND_THREE])
def test_copy_out_is_round_to_nearest_even_of_the_master(
    isa: str, n: int, grad_dtype: torch.dtype, out_dtype: torch.dtype
) -> None:
    master, m, v = flat_state(n)
    grads = torch.randn(n).to(grad_dtype)
    out = torch.full((n,), float("nan"), dtype=out_dtype)
    for step in (1, 2):
        zo.adam_step_flat(ADAMW, step, master, grads, m, v, params_out=out)
        assert torch.equal(out, master.to(out_dtype))


@pytest.mark.parametrize("grad_dtype", HALF_DTYPES)
def test_low_precision_grads_give_the_result_of_upcasting_first(isa: str, grad_dtype: torch.dtype) -> None:
    n = 100003
    grads = torch.randn(n).to(grad_dtype)
    low = flat_state(n)
    up = tuple(t.clone() for t in low)
    zo.adam_step_flat(ADAMW, 3, low[0], grads, low[1], low[2], grad_scale=0.25)
    zo.adam_step_flat(ADAMW, 3, up[0], grads.float(), up[1], up[2], grad_scale=0.25)
    for a, b in zip(low, up):
        assert torch.equal(a, b)


def test_grad_scale_equals_scaling_the_gradient_first() -> None:
    n = 4099
    grads = torch.randn(n) * 1024
    scaled = flat_state(n)
    prescaled = tuple(t.clone() for t in scaled)
    zo.adam_step_flat(ADAMW, 1, *scaled[:1], grads, *scaled[1:], grad_scale=1 / 1024)
    zo.adam_step_flat(ADAMW, 1, *prescaled[:1], grads * (1 / 1024), *prescaled[1:])
    for a, b in zip(scaled, prescaled):
        assert torch.equal(a, b)


def test_flat_step_matches_torch_adamw_on_the_same_buffers() -> None:
    n = 20001
    master, _, _ = flat_state(n)
    m, v = torch.zeros(n), torch.zeros(n)
    ref = master.clone().requires_grad_()
    opt = torch.optim.AdamW([ref], lr=1e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 51):
        g = torch.randn(n, generator=gen)
        ref.grad = g.clone()
        opt.step()
        zo.adam_step_flat(ADAMW, step, master, g, m, v)
    torch.testing.assert_close(master, ref.detach(), rtol=1e-6, atol=1e-6 * float(ref.detach().abs().max()))


def test_list_of_tensors_equals_one_flat_buffer() -> None:
    sizes = [1, 7, 33, 70000, 5]
    n = sum(sizes)
    flat = flat_state(n)
    grads = torch.randn(n, dtype=torch.bfloat16)
    out_flat = torch.empty(n, dtype=torch.bfloat16)
    pieces = [t.clone().split(sizes) for t in flat]
    out_pieces = torch.empty(n, dtype=torch.bfloat16).split(sizes)
    zo.adam_step_flat(ADAMW, 4, flat[0], grads, flat[1], flat[2], params_out=out_flat)
    zo.adam_step(ADAMW, 4, pieces[0], grads.split(sizes), pieces[1], pieces[2], params_out=out_pieces)
    assert torch.equal(torch.cat(pieces[0]), flat[0])
    assert torch.equal(torch.cat(out_pieces), out_flat)


def test_results_do_not_depend_on_the_thread_count() -> None:
    runs = []
    for threads in (1, 2, 3):
        state = flat_state(300007)
        grads = torch.randn(300007, generator=torch.Generator().manual_seed(5))
        zo.adam_step_flat(ADAMW, 2, state[0], grads, state[1], state[2], num_threads=threads)
        runs.append(state)
    for state in runs[1:]:
        for a, b in zip(state, runs[0]):
            assert torch.equal(a, b)


# --------------------------------------------------- unscale and check --

def grads_of_every_dtype(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    spec = [(torch.float32, 1), (torch.bfloat16, 7), (torch.float16, 1000),
            (torch.float32, ONE_MILLION_AND_THREE), (torch.bfloat16, 65537), (torch.float16, 17)]
    return [(torch.randn(n, generator=gen) * 3).to(dtype) for dtype, n in spec]


def test_norms_match_float64(isa: str) -> None:
    grads = grads_of_every_dtype()
    scale = 1 / 3
    check = zo.unscale_and_check(grads, scale, write_back=False)
    expected = [float(((g.double() * scale) ** 2).sum()) for g in grads]
    assert not check.nonfinite
    assert check.buffer_sum_sq == pytest.approx(expected, rel=1e-6)
    assert check.sum_sq == pytest.approx(sum(expected), rel=1e-6)
    assert check.norm == pytest.approx(sum(expected) ** 0.5, rel=1e-6)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_a_single_inf_or_nan_anywhere_is_found(isa: str, bad: float) -> None:
    grads = grads_of_every_dtype(1)
    assert not zo.unscale_and_check(grads, 0.5, write_back=False).nonfinite
    gen = torch.Generator().manual_seed(2)
    for k, g in enumerate(grads):
        for index in {0, g.numel() // 2, g.numel() - 1, int(torch.randint(g.numel(), (1,), generator=gen))}:
            saved = g[index].clone()
            g[index] = bad
            check = zo.unscale_and_check(grads, 0.5, write_back=False)
            g[index] = saved
            assert check.nonfinite, (k, index)
            finite = [s == s and abs(s) != float("inf") for s in check.buffer_sum_sq]
            assert finite == [j != k for j in range(len(grads))]


def test_write_back_stores_the_scaled_values(isa: str) -> None:
    grads = grads_of_every_dtype(3)
    before = [g.clone() for g in grads]
    zo.unscale_and_check(grads, 0.3)
    for g, b in zip(grads, before):
        assert torch.equal(g, (b.float() * 0.3).to(g.dtype))
    untouched = [g.clone() for g in grads]
    zo.unscale_and_check(grads, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(grads, untouched))


# ------------------------------------------------------------ bad input --

def good_args(n: int = 16) -> dict:
    p, m, v = flat_state(n)
    return dict(params=p, grads=torch.randn(n), exp_avg=m, exp_avg_sq=v,
                params_out=torch.zeros(n, dtype=torch.bfloat16))


def misaligned_float32(n: int) -> torch.Tensor:
    storage = torch.zeros(4 * n + 4, dtype=torch.uint8)
    return torch.frombuffer(memoryview(storage.numpy()), dtype=torch.float32, count=n, offset=1)


BAD_INPUT = [
    ("grads", lambda a: torch.randn(15), "has 15 elements"),
    ("exp_avg_sq", lambda a: torch.zeros(17), "has 17 elements"),
    ("params_out", lambda a: torch.zeros(16), "expected one of: torch.bfloat16, torch.float16"),
    ("grads", lambda a: torch.zeros(16, dtype=torch.float64), "dtype=torch.float64"),
    ("grads", lambda a: torch.zeros(16, dtype=torch.int32), "dtype=torch.int32"),
    ("params", lambda a: a["params"].to(torch.float16), "dtype=torch.float16"),
    ("exp_avg_sq", lambda a: a["exp_avg_sq"].to(torch.bfloat16), "dtype=torch.bfloat16"),
    ("exp_avg", lambda a: torch.zeros(32)[::2], "not contiguous"),
    ("grads", lambda a: torch.zeros(16, device="meta"), "device=meta"),
    ("exp_avg", lambda a: torch.zeros(16).to_sparse(), "layout"),
    ("exp_avg", lambda a: misaligned_float32(16), "not aligned"),
    ("exp_avg_sq", lambda a: a["exp_avg"], "overlap"),
    ("params_out", lambda a: a["params"].view(torch.bfloat16)[:16], "overlap"),
]


@pytest.mark.parametrize("name, spoil, message", BAD_INPUT, ids=[f"{b[0]}-{b[2]}" for b in BAD_INPUT])
def test_bad_flat_input_is_rejected_before_any_byte_is_written(name: str, spoil, message: str) -> None:
    good = good_args()
    bad = good_args()
    bad[name] = spoil(bad)
    snapshot = {k: v.clone() for k, v in good.items()}

    def pieces(key: str) -> list[torch.Tensor]:
        return [good[key], bad[key]]

    with pytest.raises(zcore.InvalidArgumentError, match=message):
        zo.adam_step(ADAMW, 1, pieces("params"), pieces("grads"), pieces("exp_avg"),
                     pieces("exp_avg_sq"), params_out=pieces("params_out"))
    for key, value in good.items():
        assert torch.equal(value, snapshot[key]), key


def test_mismatched_list_lengths_and_bad_steps_are_rejected() -> None:
    a = good_args()
    with pytest.raises(zcore.InvalidArgumentError, match="grads has 2 tensors but params has 1"):
        zo.adam_step(ADAMW, 1, [a["params"]], [a["grads"], a["grads"]], [a["exp_avg"]], [a["exp_avg_sq"]])
    with pytest.raises(zcore.InvalidArgumentError, match="step=0"):
        zo.adam_step_flat(ADAMW, 0, a["params"], a["grads"], a["exp_avg"], a["exp_avg_sq"])
    with pytest.raises(zcore.InvalidArgumentError, match="params is empty"):
        zo.adam_step(ADAMW, 1, [], [], [], [])
    with pytest.raises(zcore.InvalidArgumentError, match="threads=0"):
        zo.adam_step_flat(ADAMW, 1, a["params"], a["grads"], a["exp_avg"], a["exp_avg_sq"], num_threads=0)
    with pytest.raises(zcore.InvalidArgumentError, match="beta parameter at index 1"):
        zo.AdamConfig(betas=(0.9, 1.0))


def test_bad_unscale_input_is_rejected_before_any_byte_is_written() -> None:
    g = torch.ones(64)
    with pytest.raises(zcore.InvalidArgumentError, match="overlap"):
        zo.unscale_and_check([g, g[10:20]], 0.5)
    with pytest.raises(zcore.InvalidArgumentError, match="dtype=torch.float64"):
        zo.unscale_and_check([g, torch.ones(3, dtype=torch.float64)], 0.5)
    with pytest.raises(zcore.InvalidArgumentError, match="not contiguous"):
        zo.unscale_and_check([g, torch.ones(8, 8).t()], 0.5)
    with pytest.raises(zcore.InvalidArgumentError, match="scale"):
        zo.unscale_and_check([g], float("inf"))
    assert torch.equal(g, torch.ones(64))
