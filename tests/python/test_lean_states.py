"""bf16 master weights and bf16 optimizer states (DeepSpeed's
``bf16.bf16_master_weights_and_grads`` and ``bf16.bf16_optimizer_states``)
on each tier the states can live on, against single-process references
written here:

- in device memory, torch's AdamW steps the bf16 master pieces: the
  reference is torch.optim.AdamW over a bf16 model (its moments bf16 too);
- on the host and on NVMe, zcore's fused Adam steps in fp32 and rounds once:
  the reference is torch.optim.AdamW over fp32 copies of the bf16 values,
  whose results (weights, and moments when they are bf16) are rounded to
  bf16 after every step.

Both references accumulate the micro-batches' gradients in fp32, clip by
their fp32 norm and hand AdamW the clipped gradient rounded to bf16, as
zcore does. Tolerances over 20 steps: the two sides differ in the order of
fp32 gradient sums and in where the 1/accumulation scale is applied, which
now and then moves a bf16 rounding of a weight by one ulp, and later steps
carry it on (the bf16 mixed-precision tests measure the same); measured on
2 ranks: losses within 7.7e-5 relative, parameters within 4.8 ulps (2^-8
relative) per tensor. Bounds: 2e-4 and 8 ulps. So the single optimizer
step is also compared on the engine's own inputs, where it is exact.
"""

from __future__ import annotations

import re

import pytest
import torch

import devices
import test_checkpoint as checkpoint_test
import zcore
from distributed import run_ranks
from models import forward, global_batch, loss_of, make_model, takes_tokens
from training import LR, WEIGHT_DECAY, assert_matches, rows, train_zcore, zcore_config
from zcore.config.schema import load_config

STEPS = 20
LOSS_TOLERANCE = 2e-4
PARAM_TOLERANCE = 8 * 2.0**-8
GAS, CLIP = 2, 0.05
# (tier of the optimizer states, bf16 moments): every combination zcore offers.
TIERS = [("none", True), ("cpu", False), ("cpu", True), ("nvme", True)]


def lean_config(stage: int, tier: str, bf16_states: bool, nvme_path: str) -> dict:
    config = zcore_config(stage, GAS, CLIP, "bf16", zero={"stage3_param_persistence_threshold": 0})
    config["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=bf16_states)
    offload = {"device": tier} if tier != "nvme" else {"device": "nvme", "nvme_path": nvme_path}
    config["zero_optimization"]["offload_optimizer"] = offload
    return config


def train_reference(model_name: str, world: int, fused: bool, bf16_states: bool) -> dict:
    """The module docstring's references; ``fused``: zcore's fused Adam
    (host, NVMe) rather than torch's bf16 AdamW (device)."""
    model = make_model(model_name).to(torch.bfloat16)
    params = [p for p in model.parameters() if p.requires_grad]
    if fused:
        upcast = [p.detach().float().requires_grad_() for p in params]
        opt = torch.optim.AdamW(upcast, lr=LR, weight_decay=WEIGHT_DECAY)
    else:
        opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
    parts = world * GAS
    losses = []
    for step in range(STEPS):
        x, y = global_batch(model_name, step, 8)
        sums = [torch.zeros_like(p, dtype=torch.float32) for p in params]
        total = 0.0
        for q in range(parts):
            part = rows(q, parts)
            xs = x[part] if takes_tokens(model_name) else x[part].bfloat16()
            loss = loss_of(model_name, forward(model_name, model, xs, step, rank=q % world), y[part])
            (loss / parts).backward()
            total += loss.item()
            for s, p in zip(sums, params):
                s += p.grad.float()
                p.grad = None
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(s) for s in sums]))
        coefficient = min(1.0, CLIP / (float(norm) + 1e-6))
        grads = [(s * coefficient).bfloat16() for s in sums]
        with torch.no_grad():
            if fused:
                for u, g in zip(upcast, grads):
                    u.grad = g.float()
                opt.step()
                for p, u in zip(params, upcast):
                    p.copy_(u)
                    u.copy_(p)  # the bf16 value is the master
                    if bf16_states:
                        for key in ("exp_avg", "exp_avg_sq"):
                            opt.state[u][key].copy_(opt.state[u][key].bfloat16())
            else:
                for p, g in zip(params, grads):
                    p.grad = g
                opt.step()
                for p in params:
                    p.grad = None
        losses.append(total / parts)
    return {"losses": losses, "params": {n: p.detach().float().clone() for n, p in model.named_parameters()}}


def run_lean(rank: int, world: int, nvme_path: str) -> dict:
    devices.init_process_group("cpu")
    out = {}
    for tier, bf16_states in TIERS:
        for stage in (1, 2, 3):
            config = lean_config(stage, tier, bf16_states, f"{nvme_path}/{tier}{stage}")
            got = train_zcore(rank, world, "gpt", config, STEPS, inspect=_state_dtypes)
            out[(tier, bf16_states, stage)] = got
    return out


def _state_dtypes(engine) -> dict:
    optimizer = engine.optimizer
    master = optimizer.master
    moments = {v.dtype for s in optimizer.inner.state.values() for k, v in s.items() if k != "step"}
    return {"master": master.dtype if hasattr(master, "dtype") else master.shards[0].dtype, "moments": moments}


@pytest.fixture(scope="module")
def lean_runs(tmp_path_factory) -> dict:
    """Every tier at stages 1-3 on 2 ranks, in one launch."""
    nvme = tmp_path_factory.mktemp("lean_nvme")
    return run_ranks(run_lean, 2, str(nvme), launcher=True, timeout=900)[0]


@pytest.mark.parametrize("tier, bf16_states", TIERS, ids=[f"{t}-{'bf16' if b else 'fp32'}-moments" for t, b in TIERS])
def test_bf16_master_weights_train_as_their_reference_at_stages_1_to_3(lean_runs, tier, bf16_states):
    reference = train_reference("gpt", 2, fused=tier != "none", bf16_states=bf16_states)
    for stage in (1, 2, 3):
        got = lean_runs[(tier, bf16_states, stage)]
        label = f"stage {stage}, states on {tier}, {'bf16' if bf16_states else 'fp32'} moments"
        assert got["inspected"]["master"] == torch.bfloat16, label
        if tier != "nvme":  # on NVMe the moments rest in the sub-groups, not in the optimizer's state
            assert got["inspected"]["moments"] == {torch.bfloat16 if bf16_states else torch.float32}, label
        assert_matches(got, reference, LOSS_TOLERANCE, label, PARAM_TOLERANCE)


def one_step(rank: int, world: int, tier: str, bf16_states: bool, device: str) -> dict:
    """The inputs of the third optimizer step at stage 1 (bf16 master
    shards, moments, fp32 gradient shards: no clipping, no loss scale) and
    the master shards it leaves, on the CPU."""
    on = devices.init_process_group(device)
    config = lean_config(1, tier, bf16_states, "")
    config["gradient_clipping"] = 0.0
    engine, _, _, _ = zcore.initialize(model=make_model("gpt"), config=config)
    devices.assert_on(engine, device)
    optimizer = engine.optimizer
    for step in range(3):
        x, y = global_batch("gpt", step, 8)
        for m in range(GAS):
            part = rows(m, GAS)
            engine.backward(loss_of("gpt", forward("gpt", engine, x[part].to(on), step, 0), y[part].to(on)))
            if m == GAS - 1 and step == 2:
                before = {
                    "master": [s.cpu().clone() for s in optimizer.master.shards],
                    "grads": [optimizer.reducer.grad_shard(u).cpu().clone() for u in range(len(optimizer.units))],
                    "states": {i: {k: v.cpu().clone() for k, v in optimizer.inner.state[piece].items()}
                               for i, piece in enumerate(optimizer.inner.param_groups[0]["params"])},
                    "pieces": [(u, meta.shard_start, meta.numel) for u, unit in enumerate(optimizer.units)
                               for meta in unit.pieces],
                }
            engine.step()
    after = [s.cpu().clone() for s in optimizer.master.shards]
    engine.destroy()
    return {"before": before, "after": after}


@pytest.mark.parametrize("tier, bf16_states", TIERS[:3], ids=[f"{t}-{'bf16' if b else 'fp32'}-moments" for t, b in TIERS[:3]])
@pytest.mark.device
def test_one_step_is_its_reference_to_the_bit(tier, bf16_states, device):
    """One optimizer step on the engine's own inputs (world 1, on the test
    device): on the device, torch's AdamW over bf16 tensors, there; on the
    host, torch's fp32 AdamW on the upcast values rounded once, to the bit
    but where torch's sqrt (MKL's, not correctly rounded) moves a rounding
    by one ulp."""
    (got,) = run_ranks(one_step, 1, tier, bf16_states, device, launcher=False, timeout=300)
    before = got["before"]
    assert before["master"][0].dtype == torch.bfloat16
    expected = [m.clone() for m in before["master"]]
    for i, (u, start, numel) in enumerate(before["pieces"]):
        state = before["states"][i]
        grad = before["grads"][u][start : start + numel]
        master = expected[u][start : start + numel]
        if tier == "none":  # where the engine stepped: the test device
            p = master.to(device, copy=True).requires_grad_()
            opt = torch.optim.AdamW([p], lr=LR, weight_decay=WEIGHT_DECAY)
            p.grad = grad.to(device).bfloat16()
            state = {k: v.to(device) if v.dim() else v for k, v in state.items()}
        else:
            p = master.float().requires_grad_()
            opt = torch.optim.AdamW([p], lr=LR, weight_decay=WEIGHT_DECAY)
            p.grad = grad.bfloat16().float()  # the host takes its gradients in the master's dtype
            state = {k: v.float() for k, v in state.items()}
        opt.state[p] = {k: v.clone() for k, v in state.items()}
        opt.step()
        master.copy_(p.detach().cpu())
    for u, (want, have) in enumerate(zip(expected, got["after"])):
        equal = (want == have).float().mean().item()
        assert equal == 1.0 if tier == "none" else equal > 0.999, f"unit {u}: {equal:.6f} of the elements equal"
        torch.testing.assert_close(have.float(), want.float(), rtol=2**-8, atol=0.0)


@pytest.mark.parametrize("tier, bf16_states, per_element", [("none", True, 6), ("cpu", False, 10), ("cpu", True, 6)])
def test_memory_report_counts_the_bytes_deepspeed_quotes(lean_runs, tier, bf16_states, per_element):
    """DeepSpeed's figures: a master weight and two moments take 12 bytes in
    fp32, 6 in bf16, and 10 with fp32 moments beside a bf16 weight; each of
    2 ranks holds half (stage 2), padding aside."""
    report = lean_runs[(tier, bf16_states, 2)]["memory"]
    expected = per_element * report.trainable_parameters / 2
    assert abs(report.measured.optimizer_states - expected) <= 0.02 * expected
    assert report.measured.optimizer_states == pytest.approx(report.theoretical.optimizer_states, rel=0.02)


def checkpoint_config(stage: int, tier: str, master_and_moments: tuple[bool, bool], nvme: str) -> dict:
    """test_checkpoint's config (12 rows a step, clipping) in bf16, with
    ``master_and_moments``: whether each is bf16."""
    config = checkpoint_test.config(stage, zero={"stage3_param_persistence_threshold": 0})
    config["bf16"] = {"enabled": True, "bf16_master_weights_and_grads": master_and_moments[0],
                      "bf16_optimizer_states": master_and_moments[1]}
    offload = {"device": tier} if tier != "nvme" else {"device": "nvme", "nvme_path": nvme}
    config["zero_optimization"]["offload_optimizer"] = offload
    return config


def test_a_lean_checkpoint_resumes_to_the_bit_and_at_other_world_sizes(tmp_path):
    lean = checkpoint_config(2, "cpu", (True, False), "")
    ckpt = str(tmp_path / "ckpt")
    ref = run_ranks(checkpoint_test.uninterrupted, 2, "gpt", lean, ckpt)[0]
    again = run_ranks(checkpoint_test.resumed, 2, "gpt", lean, ckpt)[0]
    assert again["losses"] == ref[checkpoint_test.SAVE_AT:]
    # Other ranks sum the gradients in another order, which moves bf16 roundings (module docstring).
    for world, tier in ((3, "nvme"), (1, "none")):
        other = checkpoint_config(3, tier, (True, True), str(tmp_path / f"swap{world}"))
        got = run_ranks(checkpoint_test.resumed, world, "gpt", other, ckpt, timeout=400)[0]
        for a, b in zip(got["losses"], ref[checkpoint_test.SAVE_AT:], strict=True):
            assert abs(a - b) <= LOSS_TOLERANCE * abs(b), (world, tier, a, b)


def test_checkpoints_move_between_fp32_and_bf16_master_weights(tmp_path):
    """An fp32 checkpoint loads into bf16 master weights and moments (rounded
    to nearest even), and a bf16 one into fp32 (exactly), on NVMe too."""
    swap = str(tmp_path / "swap")
    fp32 = checkpoint_config(1, "cpu", (False, False), "")
    fp32_ckpt, lean_ckpt = str(tmp_path / "fp32"), str(tmp_path / "lean")
    run_ranks(checkpoint_test.uninterrupted, 2, "gpt", fp32, fp32_ckpt)
    saved = run_ranks(checkpoint_test.full_state_after_load, 2, "gpt", fp32, fp32_ckpt)[0]
    for tier in ("none", "cpu", "nvme"):
        lean = checkpoint_config(2, tier, (True, True), swap)
        loaded = run_ranks(checkpoint_test.full_state_after_load, 2, "gpt", lean, fp32_ckpt)[0]
        for key, value in saved.items():
            assert torch.equal(loaded[key], value.bfloat16().float()), (tier, key)
    run_ranks(checkpoint_test.uninterrupted, 2, "gpt", checkpoint_config(3, "nvme", (True, True), swap), lean_ckpt)
    lean_state = run_ranks(checkpoint_test.full_state_after_load, 1, "gpt", checkpoint_config(1, "none", (True, True), ""), lean_ckpt)[0]
    back = run_ranks(checkpoint_test.full_state_after_load, 1, "gpt", fp32, lean_ckpt)[0]
    for key, value in lean_state.items():
        assert torch.equal(back[key], value), key
    # And the moments: an fp32 run resumes from the lean checkpoint, bf16 moments upcast.
    resumed = run_ranks(checkpoint_test.resumed, 2, "gpt", fp32, lean_ckpt)[0]
    assert resumed["steps_at_load"] == checkpoint_test.SAVE_AT


def test_deepspeeds_offload_template_for_bf16_states_is_taken():
    """DeepSpeed's CPU Adam wants fp32_optimizer_states false beside
    bf16_optimizer_states; zcore reads the pair as one choice."""
    config = lean_config(2, "cpu", True, "")
    config["optimizer"]["params"]["fp32_optimizer_states"] = False
    assert load_config(config).bf16.bf16_optimizer_states
    del config["bf16"]["bf16_optimizer_states"]
    with pytest.raises(zcore.ConfigError, match="fp32_optimizer_states is false.*bf16.bf16_optimizer_states"):
        load_config(config)


@pytest.mark.parametrize("bf16, match", [
    ({"enabled": True, "bf16_optimizer_states": True}, "needs bf16.bf16_master_weights_and_grads"),
    ({"enabled": False, "bf16_master_weights_and_grads": True}, "set bf16.enabled true"),
])
def test_inconsistent_bf16_keys_are_refused_with_the_fix(bf16, match):
    with pytest.raises(zcore.ConfigError, match=match):
        load_config({**zcore_config(2, 1, 0.0), "bf16": bf16})


OPTIMIZERS = {
    "Muon": {"type": "Muon", "params": {"lr": 0.02}},
    "OneBitAdam": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 2}},
}


def refused_at_initialize(rank: int, world: int, tier: str, nvme: str, optimizer: str, stage: int) -> str:
    devices.init_process_group("cpu")
    config = lean_config(stage, tier, False, nvme)
    if optimizer:
        config["optimizer"] = OPTIMIZERS[optimizer]
    try:
        zcore.initialize(model=make_model("gpt"), config=config)
    except zcore.ConfigError as exc:
        return str(exc)
    return "initialized"


@pytest.mark.parametrize("tier, optimizer, stage, match", [
    ("none", "", 2, "AdamW keeps its states in its parameters' dtype.*offload_optimizer.device to 'cpu'"),
    ("nvme", "", 2, "on NVMe keep the master weights and the moments in one dtype"),
    ("cpu", "Muon", 2, "Muon keeps its states in its parameters' dtype \\(bf16\\): set bf16.bf16_optimizer_states to true$"),
    ("none", "OneBitAdam", 0, "OneBitAdam keeps its states in its parameters' dtype"),
])
def test_fp32_moments_beside_bf16_weights_where_they_cannot_be_are_refused(tier, optimizer, stage, match, tmp_path):
    (message,) = run_ranks(refused_at_initialize, 1, tier, str(tmp_path), optimizer, stage, launcher=False, timeout=120)
    assert re.search(match, message), message


def muon_first_step(rank: int, world: int) -> dict:
    """Muon (and AdamW for the others) with bf16 master weights and moments,
    clipped: the AdamW pieces' first moments after one step, and the fp32
    gradients they came from."""
    devices.init_process_group("cpu")
    config = lean_config(1, "none", True, "")
    config["gradient_accumulation_steps"] = 1
    config["optimizer"] = {"type": "Muon", "params": {"lr": 0.02, "adam_lr": LR}}
    engine, _, _, _ = zcore.initialize(model=make_model("gpt"), config=config)
    optimizer = engine.optimizer
    x, y = global_batch("gpt", 0, 8)
    engine.backward(loss_of("gpt", forward("gpt", engine, x, 0, 0), y))
    grads = [optimizer.reducer.grad_shard(u).clone() for u in range(len(optimizer.units))]
    engine.step()
    inner = optimizer.inner
    adam = [(u, meta.shard_start, meta.numel, inner.state[piece]["exp_avg"].clone())
            for u, (unit, pieces) in enumerate(zip(optimizer.units, optimizer.master.pieces))
            for meta, piece in zip(unit.pieces, pieces) if "exp_avg" in inner.state.get(piece, {})]
    engine.destroy()
    return {"grads": grads, "adam": adam}


def test_muons_adamw_half_takes_the_clipped_gradient_with_bf16_master_weights():
    """A first moment is (1 - beta1) times the clipped gradient rounded to
    bf16: the coefficient clip / norm is far from 1 here."""
    (got,) = run_ranks(muon_first_step, 1, launcher=False, timeout=120)
    norm = float(torch.linalg.vector_norm(torch.cat([g.double() for g in got["grads"]])))
    coefficient = CLIP / (norm + 1e-6)
    assert coefficient < 0.5 and got["adam"]
    for u, start, numel, exp_avg in got["adam"]:
        grad = (got["grads"][u][start : start + numel] * coefficient).bfloat16()
        expected = (grad * (1 - 0.9)).bfloat16()  # torch's lerp from zero, in bf16
        torch.testing.assert_close(exp_avg.float(), expected.float(), rtol=2**-7, atol=1e-12)
