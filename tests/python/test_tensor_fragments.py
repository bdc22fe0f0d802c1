"""DeepSpeed's tensor-fragment calls (zcore.utils, as deepspeed.utils):
one parameter's master weights, optimizer states and gradient, whole or this
rank's part, read and written at every stage and tier, against torch.

Two ranks train a small model (its second layer's pieces fall on both
ranks, its last bias on one). The reference is single-process torch: the
model built from the same seed, the gradient of the ranks' mean loss, and
torch.optim.AdamW stepping from the values the calls wrote. All cases run
in one spawn of the ranks (engines one after another).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import devices
import zcore
from distributed import run_ranks
from zcore.errors import InvalidArgumentError, InvalidStateError
from zcore.utils import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
    safe_update_full_grad_vectorized,
)

WORLD = 2
LR, BETAS, EPS, DECAY = 1e-2, (0.9, 0.999), 1e-8, 0.01
STATES = ("exp_avg", "exp_avg_sq")
LOCAL = 50  # the values of the local writes: written(LOCAL + i, ...)


def make_model(frozen: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Tanh(), torch.nn.Linear(7, 5), torch.nn.Tanh(),
                                torch.nn.Linear(5, 1))
    if frozen:
        model[0].requires_grad_(False)
    return model


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + seed)
    return torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)


def written(index: int, shape: torch.Size, what: str) -> torch.Tensor:
    """The value a case writes: the same on every rank."""
    g = torch.Generator().manual_seed(1000 * index + {"param": 1, "exp_avg": 2, "exp_avg_sq": 3, "grad": 4}[what])
    value = torch.randn(shape, generator=g)
    return value.abs() * 1e-3 if what == "exp_avg_sq" else value * 0.1


def cases(nvme: str) -> dict[str, tuple[dict, bool]]:
    """label -> (zero_optimization plus precision keys, first layer frozen)."""
    on_nvme = {"device": "nvme", "nvme_path": nvme}
    small = {"sub_group_size": 20}  # a piece spans sub-groups
    return {
        "stage 0": ({"zero_optimization": {"stage": 0}}, False),
        "stage 1": ({"zero_optimization": {"stage": 1}}, False),
        "stage 2": ({"zero_optimization": {"stage": 2}}, False),
        "stage 3": ({"zero_optimization": {"stage": 3}}, False),
        "stage 3, frozen layer": ({"zero_optimization": {"stage": 3}}, True),
        "stage 1, frozen layer": ({"zero_optimization": {"stage": 1}}, True),
        "stage 2, optimizer on the host": ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
                                           False),
        "stage 3, optimizer and parameters on the host": (
            {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                   "offload_param": {"device": "cpu"}}}, False),
        "stage 1, optimizer on nvme": ({"zero_optimization": {"stage": 1, "offload_optimizer": on_nvme, **small}},
                                       False),
        "stage 3, optimizer on nvme": ({"zero_optimization": {"stage": 3, "offload_optimizer": on_nvme, **small}},
                                       False),
        "stage 3, bf16": ({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}, False),
        "stage 2, fp16": ({"zero_optimization": {"stage": 2}, "fp16": {"enabled": True, "initial_scale_power": 4}},
                          False),
    }


def fp32(label: str) -> bool:
    return "bf16" not in label and "fp16" not in label


def run_case(rank: int, zero: dict, frozen: bool, on: torch.device = torch.device("cpu")) -> dict:
    stage = zero["zero_optimization"]["stage"]
    model = make_model(frozen)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": DECAY}},
        **zero,
    }
    shapes = {n: p.shape for n, p in model.named_parameters()}  # ZeRO-3 leaves placeholders
    engine, *_ = zcore.initialize(model=model, config=config)
    named = list(model.named_parameters())
    out: dict = {"initial": {n: safe_get_full_fp32_param(p) for n, p in named},
                 "grad before backward": {n: safe_get_full_grad(p) for n, p in named}}

    dtype = torch.bfloat16 if "bf16" in zero else torch.float16 if "fp16" in zero else torch.float32

    def mse(x, y):
        return torch.nn.functional.mse_loss(engine(x.to(on, dtype)).float(), y.to(on))

    engine.backward(mse(*batch(rank)))
    out["grad"] = {n: safe_get_full_grad(p) for n, p in named}
    out["local grad"] = {n: safe_get_local_grad(p) for n, p in named}
    engine.step()
    out["grad after step"] = {n: safe_get_full_grad(p) for n, p in named}
    out["master"] = {n: safe_get_full_fp32_param(p) for n, p in named}
    out["local master"] = {n: safe_get_local_fp32_param(p) for n, p in named}
    for key in STATES:
        out[key] = {n: safe_get_full_optimizer_state(p, key) for n, p in named}
        out["local " + key] = {n: safe_get_local_optimizer_state(p, key) for n, p in named}

    # Writes: every rank the same whole values; read back whole.
    for i, (n, p) in enumerate(named):
        safe_set_full_fp32_param(p, written(i, shapes[n], "param"))
        for key in STATES:
            safe_set_full_optimizer_state(p, written(i, shapes[n], key), key)
    out["read back"] = {n: [safe_get_full_fp32_param(p)] + [safe_get_full_optimizer_state(p, k) for k in STATES]
                        for n, p in named}
    engine.backward(mse(*batch(rank + 10)))
    first, *rest = named
    safe_update_full_grad_vectorized([first[1]], lambda grad, p: written(0, shapes[first[0]], "grad"))
    for i, (n, p) in enumerate(rest, start=1):
        safe_set_full_grad(p, written(i, shapes[n], "grad"))
    out["grad read back"] = {n: safe_get_full_grad(p) for n, p in named}
    out["loss scale"] = engine.optimizer.loss_scale
    engine.step()
    out["stepped from written"] = {n: safe_get_full_fp32_param(p) for n, p in named}
    with torch.no_grad():
        out["forward"] = engine(torch.ones(2, 6, dtype=dtype, device=on)).float()

    # Local writes: this rank's part of new whole values (those of
    # ``written(LOCAL + i, ...)``); read back whole.
    sizes = [0] * WORLD
    out["local writes read back"] = {}
    for i, (n, p) in enumerate(named):
        part = safe_get_local_fp32_param(p)
        if part is None:
            continue
        dist.all_gather_object(sizes, part.numel())
        start = 0 if stage == 0 else sum(sizes[:rank])  # stage 0: every rank's part is the whole
        mine = slice(start, start + part.numel())
        safe_set_local_fp32_param(p, written(LOCAL + i, shapes[n], "param").reshape(-1)[mine])
        for k in STATES:
            safe_set_local_optimizer_state(p, written(LOCAL + i, shapes[n], k).reshape(-1)[mine], k)
    engine.backward(mse(*batch(rank + 20)))
    for i, (n, p) in enumerate(named):
        part = safe_get_local_grad(p)
        if part is None:
            continue
        dist.all_gather_object(sizes, part.numel())
        start = 0 if stage == 0 else sum(sizes[:rank])
        safe_set_local_grad(p, written(LOCAL + i, shapes[n], "grad").reshape(-1)[start : start + part.numel()])
    out["local writes read back"] = {
        n: [safe_get_full_fp32_param(p), *(safe_get_full_optimizer_state(p, k) for k in STATES), safe_get_full_grad(p)]
        for n, p in named
    }
    engine.destroy()
    return out


MOMENTUM = 0.9


def run_muon(rank: int, stage: int) -> dict:
    """Muon's momentum for the matrices, AdamW's moments for the biases."""
    model = make_model(frozen=False)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "Muon", "params": {"lr": LR, "momentum": MOMENTUM}}}
    engine, *_ = zcore.initialize(model=model, config=config)
    x, y = batch(rank)
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()
    out = {}
    for n, p in model.named_parameters():
        key = "momentum_buffer" if n.endswith("weight") else "exp_avg"
        out[n] = (safe_get_full_optimizer_state(p, key), safe_get_local_optimizer_state(p, key))
    engine.destroy()
    return out


def train_cases(rank: int, world: int, nvme: str) -> dict:
    out = {label: run_case(rank, zero, frozen) for label, (zero, frozen) in cases(nvme).items()}
    out["muon"] = {stage: run_muon(rank, stage) for stage in (2, 3)}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    nvme = tmp_path_factory.mktemp("fragments_nvme")
    return run_ranks(train_cases, WORLD, str(nvme), timeout=600)


def reference_step(params: dict, grads: dict, states: dict, step: int) -> dict:
    """torch.optim.AdamW's step ``step`` from the given values, per name."""
    out = {}
    for name, value in params.items():
        p = torch.nn.Parameter(value.clone().double())
        opt = torch.optim.AdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY)
        if states is not None:
            opt.state[p] = {"step": torch.tensor(float(step - 1)),
                            **{k: states[k][name].clone().double() for k in STATES}}
        p.grad = grads[name].double()
        opt.step()
        out[name] = (p.detach().float(), {k: opt.state[p][k].float() for k in STATES})
    return out


def reference_grads(world: int = WORLD) -> dict:
    model = make_model(frozen=False)
    losses = [torch.nn.functional.mse_loss(model(x), y) for x, y in (batch(r) for r in range(world))]
    (sum(losses) / world).backward()
    return {n: p.grad for n, p in model.named_parameters()}


LABELS = list(cases("unused"))


@pytest.mark.parametrize("label", LABELS)
def test_every_rank_reads_the_same_whole_values_and_their_parts_make_them_up(results, label):
    by_rank = [r[label] for r in results]
    frozen = cases("unused")[label][1]
    for what, local in (("grad", "local grad"), ("master", "local master"), *((k, "local " + k) for k in STATES)):
        for name, whole in by_rank[0][what].items():
            if frozen and name.startswith("0."):
                assert whole is None and all(r[local][name] is None for r in by_rank), (what, name)
                continue
            assert all(torch.equal(r[what][name], whole) for r in by_rank), (what, name)
            parts = [r[local][name] for r in by_rank]
            if label == "stage 0":  # nothing is cut: each rank's part is the whole
                assert all(torch.equal(part, whole.reshape(-1)) for part in parts), (what, name)
            else:
                assert torch.equal(torch.cat(parts), whole.reshape(-1)), (what, name)
    # The last bias (one element) is a part of one rank only at stages 1-3.
    if "stage 0" not in label:
        assert sorted(r["local master"]["4.bias"].numel() for r in by_rank) == [0, 1]


@pytest.mark.parametrize("label", LABELS)
def test_gradients_exist_from_the_windows_backward_until_the_step(results, label):
    for r in results:
        assert all(g is None for g in r[label]["grad before backward"].values())
        assert all(g is None for g in r[label]["grad after step"].values())


@pytest.mark.parametrize("label", [label for label in LABELS if fp32(label)])
def test_reads_equal_torch(results, label):
    assert_reads_equal_torch(results[0][label], label, WORLD)


def assert_reads_equal_torch(out: dict, label: str, world: int) -> None:
    model = make_model(frozen=False)
    grads = reference_grads(world)
    stepped = reference_step({n: p.detach() for n, p in model.named_parameters()}, grads, None, 1)
    frozen = cases("unused").get(label, (None, False))[1]
    for name, p in model.named_parameters():
        if frozen and name.startswith("0."):
            assert out["initial"][name] is None and out["exp_avg"][name] is None
            continue
        assert torch.equal(out["initial"][name], p.detach()), name
        if frozen:  # the trained layers' gradients do not depend on the frozen one's
            continue
        torch.testing.assert_close(out["grad"][name], grads[name], rtol=1e-5, atol=1e-7)
        value, states = stepped[name]
        torch.testing.assert_close(out["master"][name], value, rtol=1e-5, atol=1e-6)
        for key in STATES:
            torch.testing.assert_close(out[key][name], states[key], rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("label", LABELS)
def test_written_values_read_back_and_the_step_applies_them(results, label):
    assert_writes_applied(results[0][label], label)


def assert_writes_applied(out: dict, label: str) -> None:
    frozen = cases("unused").get(label, (None, False))[1]
    names = list(out["master"])
    params, grads, states = {}, {}, {k: {} for k in STATES}
    for i, name in enumerate(names):
        shape = out["initial"][name].shape if out["initial"][name] is not None else None
        if shape is None:
            assert out["read back"][name] == [None, None, None] and out["grad read back"][name] is None
            continue
        params[name] = written(i, shape, "param")
        grads[name] = written(i, shape, "grad")
        for key in STATES:
            states[key][name] = written(i, shape, key)
        assert torch.equal(out["read back"][name][0], params[name]), name
        for key, got in zip(STATES, out["read back"][name][1:]):
            assert torch.equal(got, states[key][name]), (name, key)
        assert torch.equal(out["grad read back"][name], grads[name]), name
    # The step unscales (fp16) what it was given, as it does the gradients it reduced.
    unscaled = {n: g / out["loss scale"] for n, g in grads.items()}
    expected = reference_step(params, unscaled, states, 2)
    for name, (value, _) in expected.items():
        torch.testing.assert_close(out["stepped from written"][name], value, rtol=1e-5, atol=1e-6)
    for i, name in enumerate(names):
        got = out["local writes read back"][name]
        if name not in params:
            assert got == [None] * 4
            continue
        expected = [written(LOCAL + i, params[name].shape, k) for k in ("param", *STATES, "grad")]
        assert all(torch.equal(g, e) for g, e in zip(got, expected)), name
    if fp32(label) and not frozen:  # the model's parameters took the step's values
        model = make_model(frozen=False)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(out["stepped from written"][name])
            torch.testing.assert_close(out["forward"], model(torch.ones(2, 6)), rtol=1e-5, atol=1e-6)


# Refusals, at a world of one.
def refusals(rank: int, world: int) -> list[str]:
    model = make_model(frozen=False)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": LR}}, "zero_optimization": {"stage": 2}}
    engine, *_ = zcore.initialize(model=model, config=config)
    p = model[0].weight
    seen = []

    def expect(error, pattern, call):
        with pytest.raises(error, match=pattern):
            call()
        seen.append(pattern)

    expect(InvalidArgumentError, "not in a model that zcore.initialize trains",
           lambda: safe_get_full_fp32_param(torch.nn.Parameter(torch.zeros(2))))
    expect(InvalidArgumentError, "takes a torch.nn.Parameter", lambda: safe_get_full_fp32_param(torch.zeros(2)))
    expect(InvalidStateError, "no optimizer state 'exp_avg' yet", lambda: safe_get_full_optimizer_state(p, "exp_avg"))
    expect(InvalidStateError, "no optimizer state 'exp_avg' yet",
           lambda: safe_set_local_optimizer_state(p, torch.zeros(42), "exp_avg"))
    expect(InvalidArgumentError, r"has 5 elements .* has 42",
           lambda: safe_set_full_fp32_param(p, torch.zeros(5)))
    expect(InvalidArgumentError, "floating-point tensor", lambda: safe_set_full_fp32_param(p, [0.0] * 42))
    expect(InvalidStateError, "no gradients are held now", lambda: safe_set_full_grad(p, torch.zeros(7, 6)))
    x, y = batch(0)
    for _ in range(2):
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    expect(InvalidArgumentError, r"keeps no per-element state 'momentum_buffer'.*\['exp_avg', 'exp_avg_sq'\]",
           lambda: safe_get_full_optimizer_state(p, "momentum_buffer"))
    expect(InvalidArgumentError, "optim_state_key names an optimizer state", lambda: safe_get_full_optimizer_state(p, 1))
    engine.destroy()
    expect(InvalidStateError, "destroyed", lambda: safe_get_full_fp32_param(p))

    inference, *_ = zcore.initialize(model=make_model(frozen=False), config={"train_micro_batch_size_per_gpu": 1})
    expect(InvalidStateError, "has no optimizer", lambda: safe_get_full_fp32_param(inference.module[0].weight))
    return seen


def test_misuse_is_refused_with_the_reason():
    (seen,) = run_ranks(refusals, 1, timeout=120)
    assert len(seen) == 11  # the function ran to its end


@pytest.mark.parametrize("stage", [2, 3])
def test_a_whole_matrix_optimizers_states_equal_torchs(results, stage):
    """Muon keeps its momentum per matrix (zcore.step.matrix_step); each
    rank's part of it still makes up the whole, which equals torch.optim.Muon's."""
    grads = reference_grads()
    for name, grad in grads.items():
        whole, _ = results[0]["muon"][stage][name]
        if name.endswith("weight"):
            model = make_model(frozen=False)
            p = dict(model.named_parameters())[name]
            muon = torch.optim.Muon([p], lr=LR, momentum=MOMENTUM)
            p.grad = grad
            muon.step()
            expected = muon.state[p]["momentum_buffer"]
        else:
            expected = (1 - BETAS[0]) * grad  # AdamW's first moment after one step
        torch.testing.assert_close(whole, expected, rtol=1e-5, atol=1e-8)
        parts = [r["muon"][stage][name][1] for r in results]
        assert torch.equal(torch.cat(parts), whole.reshape(-1)), name


# On ZCORE_TEST_DEVICE (NCCL and a GPU there), at a world of one.
DEVICE_CASES = {
    "stage 2": {"zero_optimization": {"stage": 2}},
    "stage 3, optimizer on the host": {"zero_optimization": {"stage": 3, "offload_optimizer": {
        "device": "cpu", "pin_memory": True}}},
}


def on_device(rank: int, world: int, device: str) -> dict:
    on = devices.init_process_group(device)
    out = {label: run_case(rank, zero, False, on) for label, zero in DEVICE_CASES.items()}
    seen: set = set()

    def to_cpu(value):
        if isinstance(value, torch.Tensor):
            seen.add(value.device.type)
            return value.cpu()
        if isinstance(value, dict):
            return {k: to_cpu(v) for k, v in value.items()}
        if isinstance(value, list):
            return [to_cpu(v) for v in value]
        return value

    return {"cases": to_cpu(out), "devices": seen}


@pytest.mark.device
def test_on_the_device_the_calls_give_the_engines_device_and_equal_torch(device):
    (got,) = run_ranks(on_device, 1, device, launcher=False, timeout=300)
    assert got["devices"] == {device}  # the master on the host comes back on the device too
    for label, out in got["cases"].items():
        assert_reads_equal_torch(out, label, 1)
        assert_writes_applied(out, label)


# Within an accumulation window: gradient accumulation, and DeepSpeed's no_sync().
def window_gradients(rank: int, world: int, stage: int, how: str) -> dict:
    model = make_model(frozen=False)
    gas = 2 if how == "accumulation" else 1
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas, "gradient_clipping": 0,
              "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                        "weight_decay": DECAY}}}
    engine, *_ = zcore.initialize(model=model, config=config)
    named = list(model.named_parameters())

    def backward(b):
        x, y = batch(rank + 10 * b)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))

    out = {}
    if how == "accumulation":
        backward(0)
        out["mid"] = {n: safe_get_full_grad(p) for n, p in named}
        engine.step()
    else:  # DeepSpeed's loop: no step in the block; Accelerate's (the Trainer's): a step every micro-batch
        with engine.no_sync():
            backward(0)
            out["mid"] = {n: safe_get_full_grad(p) for n, p in named}
            if how == "no_sync, stepping":
                engine.step()
                out["counted"] = (engine.global_steps, engine.micro_steps)
            with pytest.raises(InvalidStateError, match="inside another no_sync"):
                with engine.no_sync():
                    pass
    backward(1)
    out["end"] = {n: safe_get_full_grad(p) for n, p in named}
    engine.step()
    out["master"] = {n: safe_get_full_fp32_param(p) for n, p in named}
    engine.destroy()
    return out


def rank_grads(rank: int, b: int) -> dict:
    model = make_model(frozen=False)
    x, y = batch(rank + 10 * b)
    torch.nn.functional.mse_loss(model(x), y).backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("how", ["accumulation", "no_sync", "no_sync, stepping"])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_within_a_window_stages_0_1_give_this_ranks_sum_and_stages_2_3_the_reduced_one(stage, how):
    """As DeepSpeed: at stages 0-1 a window's gradients are this rank's own
    (its param.grad) until the window's last backward reduces them; at
    stages 2-3 they are reduced every micro-step. The step applies the
    window's mean over the ranks of every micro-batch's gradient; in
    no_sync(), a step only counts the micro-step."""
    results = run_ranks(window_gradients, WORLD, stage, how, timeout=300)
    scale = 0.5 if how == "accumulation" else 1.0  # each backward divides by gradient_accumulation_steps
    grads = {(r, b): rank_grads(r, b) for r in range(WORLD) for b in range(2)}
    names = list(grads[(0, 0)])
    end = {n: scale * sum(grads[(r, b)][n] for r in range(WORLD) for b in range(2)) / WORLD for n in names}
    model = make_model(frozen=False)
    stepped = reference_step({n: p.detach() for n, p in model.named_parameters()}, end, None, 1)
    for rank, got in enumerate(results):
        if how == "no_sync, stepping":
            assert got["counted"] == (0, 1)  # counted, not applied
        for n in names:
            if stage < 2:
                mid = scale * grads[(rank, 0)][n]
            else:
                mid = scale * sum(grads[(r, 0)][n] for r in range(WORLD)) / WORLD
            torch.testing.assert_close(got["mid"][n], mid, rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(got["end"][n], end[n], rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(got["master"][n], stepped[n][0], rtol=1e-5, atol=1e-6)
