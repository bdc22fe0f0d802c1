"""1-bit Adam and 0/1 Adam (DeepSpeed's "OneBitAdam" and "ZeroOneAdam"
optimizer types; zcore.optim.compressed_adam) at ZeRO stage 0 on gloo ranks.

- Before compression they are Adam without bias correction, DeepSpeed's
  rule: torch's AdamW with its bias correction undone by per-step lr, eps
  and weight decay, to float rounding, at world 2.
- With compression, the tied GPT reaches the loss of that same Adam run
  uncompressed within 5%. The baseline is the optimizer's own exact rule,
  not torch's bias-corrected AdamW, whose effective step is several times
  smaller early on (measured here: 1.74 against 1.19 evaluation loss after
  60 steps at world 2; 1-bit Adam 1.20, 0/1 Adam 1.22). On the compressed
  steps the engine's gradient all-reduce is off: what each rank sends is
  counted (zcore.comm.counting_group).
- fp16 overflow on one rank skips the step on all, clipping uses each
  rank's own norm (DeepSpeed's rules with local gradients).
- Configs: DeepSpeed's accepted, the combinations that cannot work refused
  by key; checkpoints keep what DeepSpeed's load keeps.
- Memory: the error feedback (and 0/1 Adam's synchronised parameters),
  counted by engine.memory_report() and zcore.estimate_memory as the
  optimizer's tensors hold them.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import zcore
from distributed import run_ranks
from models import TinyGPT, global_batch, loss_of, make_model
from test_zero_quantized import lm_loss, sequences
from training import GLOBAL_BATCH, assert_matches, relative_error, rows, train_zcore, zcore_config
from zcore.comm import counting_group
from zcore.config.schema import load_config
from zcore.optim import OneBitAdam, ZeroOneAdam
from zcore.optim.zero_one_adam import Intervals, Phase

LR, BETAS, EPS, WD = 3e-3, (0.9, 0.999), 1e-8, 0.01


def optimizer(kind: str, **params) -> dict:
    return {"type": kind, "params": {"lr": LR, "weight_decay": WD, **params}}


# Warm-up: exactly Adam (without bias correction).
def uncorrected_adamw(steps: int, world: int, gas: int, clip: float) -> dict:
    """One process over the same global batches; torch.optim.AdamW whose
    step t runs with lr * bc1 / sqrt(bc2), eps / sqrt(bc2) and
    weight_decay * sqrt(bc2) / bc1 (bc_i = 1 - beta_i^t), which is
    p -= lr * (m / (sqrt(v) + eps) + weight_decay * p), DeepSpeed's update."""
    model = make_model("gpt")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    parts, losses = world * gas, []
    for step in range(steps):
        x, y = global_batch("gpt", step, GLOBAL_BATCH)
        total = 0.0
        for q in range(parts):
            part = rows(q, parts)
            loss = loss_of("gpt", model(x[part]), y[part])
            (loss / parts).backward()
            total += loss.item()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        bc1, bc2 = 1 - BETAS[0] ** (step + 1), 1 - BETAS[1] ** (step + 1)
        for group in opt.param_groups:
            group.update(lr=LR * bc1 / math.sqrt(bc2), eps=EPS / math.sqrt(bc2), weight_decay=WD * math.sqrt(bc2) / bc1)
        opt.step()
        opt.zero_grad()
        losses.append(total / parts)
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


WARMUP_STEPS = 10
WARMUPS = {
    "1-bit": optimizer("OneBitAdam", freeze_step=100),
    # Every one of the first var_update_scaler (16) steps updates the variance.
    "0/1": optimizer("ZeroOneAdam", var_freeze_step=100),
}


def train_warmups(rank: int, world: int, gas: int, clip: float) -> dict:
    return {
        label: train_zcore(rank, world, "gpt", {**zcore_config(0, gas, clip), "optimizer": opt}, WARMUP_STEPS)
        for label, opt in WARMUPS.items()
    }


@pytest.mark.parametrize("gas, clip", [(1, 0.0), (2, 0.05)])
def test_the_warmup_is_torch_adamw_with_bias_correction_undone(gas, clip):
    results = run_ranks(train_warmups, 2, gas, clip, timeout=120)
    reference = uncorrected_adamw(WARMUP_STEPS, 2, gas, clip)
    for label in WARMUPS:
        assert results[0][label]["optimizer"] in ("OneBitAdam", "ZeroOneAdam")
        assert_matches(results[0][label], reference, 1e-5, f"{label} gas {gas} clip {clip}")
        for name, value in results[1][label]["params"].items():
            assert torch.equal(value, results[0][label]["params"][name]), (label, name)


# Compressed training.
STEPS, FREEZE = 60, 20
RUNS = {
    "adam": optimizer("OneBitAdam", freeze_step=10**6),  # the warm-up rule throughout: uncompressed
    "1-bit": optimizer("OneBitAdam", freeze_step=FREEZE, comm_backend_name="gloo"),
    # Local steps from step 22; their interval 1, 2, then 4 (the clipper) by step 38.
    "0/1": optimizer("ZeroOneAdam", var_freeze_step=FREEZE, local_step_scaler=8, local_step_clipper=4),
}


def train_counted(rank: int, world: int, opt: dict) -> dict:
    torch.manual_seed(0)
    model = TinyGPT()
    engine, *_ = zcore.initialize(model=model, config={"train_micro_batch_size_per_gpu": 4, "optimizer": opt})
    losses, sent = [], []
    for step in range(STEPS):
        counting_group.reset()
        tokens = sequences(step, rank)
        loss = lm_loss(engine(tokens[:, :-1]), tokens)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        sent.append(counting_group.counters())
    engine.eval()
    with torch.no_grad():
        held_out = sequences(10_000, 0, rows=32)
        eval_loss = lm_loss(engine(held_out[:, :-1]), held_out).item()
    grad_bytes = 4 * sum(p.numel() for p in model.parameters())
    params = [p.detach().clone() for p in engine.module.parameters()]
    engine.destroy()
    return {"losses": losses, "eval": eval_loss, "sent": sent, "grad_bytes": grad_bytes, "params": params}


def train_all(rank: int, world: int) -> dict:
    counting_group.init_process_group()
    return {label: train_counted(rank, world, opt) for label, opt in RUNS.items()}


def compressed_bytes(sent: dict) -> float:
    return float(sent.get("all_to_all", 0) + sent.get("send", 0))  # gloo's all-gather runs as sends


# Steps (from 1) whose gradients the engine all-reduces, and those that send
# 1-bit messages, by DeepSpeed's rules for RUNS.
AVERAGED = {"1-bit": set(range(1, FREEZE + 1)), "0/1": set(range(1, 17)) | {18, 20}}
COMPRESSED = {
    "1-bit": set(range(FREEZE + 1, STEPS + 1)),
    # 1-bit gradients between variance updates; then synchronisations.
    "0/1": {17, 19, 21} | set(range(22, 30)) | {30, 32, 34, 36} | set(range(40, STEPS + 1, 4)),
}


def test_compressed_training_reaches_adams_loss_and_skips_the_all_reduce():
    results = run_ranks(train_all, 2, timeout=180)
    base = results[0]["adam"]
    assert base["losses"][-1] < 0.5 * base["losses"][0]  # it learns: the comparison means something
    grad_bytes = base["grad_bytes"]
    for label in ("1-bit", "0/1"):
        run = results[0][label]
        assert run["eval"] == pytest.approx(base["eval"], rel=0.05), label
        assert sum(run["losses"][-10:]) == pytest.approx(sum(base["losses"][-10:]), rel=0.05), label
        exact = min(COMPRESSED[label])  # the loss before the first compressed step is still Adam's
        assert run["losses"][:exact] == base["losses"][:exact], label
        assert run["losses"][exact] != base["losses"][exact], label
        for mine, other in zip(run["params"], results[1][label]["params"]):
            assert torch.equal(mine, other), label  # 0/1 Adam: step 60 synchronises
        for step, sent in enumerate(run["sent"], start=1):
            where = (label, step, sent)
            if step in AVERAGED[label]:  # fp32 all-reduce: at 2 ranks each sends its whole buffer once
                assert sent["all_reduce"] >= grad_bytes and compressed_bytes(sent) == 0, where
                continue
            # Only a few flags are all-reduced; 1-bit messages are 1/32 of the
            # gradient bytes, plus padding and scales.
            assert sent["all_reduce"] < grad_bytes / 100, where
            if step in COMPRESSED[label]:
                assert grad_bytes / 40 < compressed_bytes(sent) < grad_bytes / 20, where
            else:  # a local step that does not synchronise
                assert compressed_bytes(sent) == 0, where


# fp16 and clipping with each rank's own gradients.
def overflow_after_freeze(rank: int, world: int) -> tuple:
    torch.manual_seed(0)
    model = TinyGPT()
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": optimizer("OneBitAdam", freeze_step=1),
           "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}}
    engine, *_ = zcore.initialize(model=model, config=cfg)
    for step in range(2):
        tokens = sequences(step, rank)
        loss = lm_loss(engine(tokens[:, :-1]), tokens)
        overflow = step == 1 and rank == 1  # one rank's local gradients overflow, in the compressed phase
        engine.backward(loss * (float("inf") if overflow else 1.0))
        engine.step()
        if step == 0:
            before = [p.detach().clone() for p in engine.module.parameters()]
    after = [p.detach().clone() for p in engine.module.parameters()]
    unchanged = all(torch.equal(a, b) for a, b in zip(before, after))
    result = (engine.skipped_steps, engine.loss_scale, unchanged, engine.optimizer.inner.steps_taken)
    engine.destroy()
    return result


def test_an_overflow_on_one_rank_skips_the_compressed_step_on_every_rank():
    """Without the ranks agreeing, the rank without the overflow would
    wait in the compressed all-reduce for ever (run_ranks' timeout)."""
    for skipped, scale, unchanged, steps in run_ranks(overflow_after_freeze, 2, timeout=120):
        assert (skipped, scale, unchanged, steps) == (1, 128.0, True, 1)


def clipped_local_norms(rank: int, world: int) -> tuple:
    torch.manual_seed(0)
    model = TinyGPT()
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.01,
           "optimizer": optimizer("OneBitAdam", freeze_step=2)}
    engine, *_ = zcore.initialize(model=model, config=cfg)
    norms = []
    for step in range(4):
        tokens = sequences(step, rank)
        engine.backward(lm_loss(engine(tokens[:, :-1]), tokens))
        engine.step()
        norms.append(engine.last_grad_norm)
    params = [p.detach().clone() for p in engine.module.parameters()]
    engine.destroy()
    return norms, params


def test_clipping_uses_each_ranks_own_norm_once_compressing():
    (norms0, params0), (norms1, params1) = run_ranks(clipped_local_norms, 2, timeout=120)
    assert norms0[:2] == norms1[:2]  # warm-up: the averaged gradient's norm, everywhere
    assert norms0[2] != norms1[2] and norms0[3] != norms1[3]  # then each rank's own
    assert all(torch.equal(a, b) for a, b in zip(params0, params1))


def non_freeze_group(rank: int, world: int) -> dict:
    """Standalone (no engine): the caller averages the warm-up gradients."""
    torch.distributed.init_process_group("gloo")
    exact, frozen = torch.nn.Parameter(torch.zeros(5)), torch.nn.Parameter(torch.zeros(5))
    opt = OneBitAdam([{"params": [exact], "non_freeze": True}, {"params": [frozen]}], freeze_step=1)
    variances = []
    for step in range(3):
        grads = [torch.full((5,), float(step + 1 + rank)) for _ in range(2)]  # ranks differ
        if opt.takes_averaged_gradients():
            for g in grads:
                torch.distributed.all_reduce(g)
                g /= world
        exact.grad, frozen.grad = grads
        opt.step()
        variances.append([opt.state[p]["exp_avg_sq"].clone() for p in (exact, frozen)])
    momentum = opt.state[exact]["exp_avg"].clone()
    held = [t.numel() for t in opt.held_tensors()]
    return {"variances": variances, "exact_momentum": momentum, "exact": exact.detach().clone(), "held": held}


def test_a_non_freeze_group_stays_exact_while_the_others_compress():
    got = run_ranks(non_freeze_group, 2, timeout=60)
    # The mean gradient is 1.5, 2.5, 3.5 at steps 1-3: exact moments for the non_freeze group.
    m = v = 0.0
    for g in (1.5, 2.5, 3.5):
        m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
    for rank in got:
        assert torch.allclose(rank["exact_momentum"], torch.full((5,), m))
        assert torch.allclose(rank["variances"][-1][0], torch.full((5,), v))
        assert torch.equal(rank["variances"][-1][1], rank["variances"][0][1])  # frozen after step 1
        assert rank["held"] == [16, 8]  # error feedback for the compressed group only: 5 padded to 16, and 16 / 2
    assert torch.equal(got[0]["exact"], got[1]["exact"])


# The schedules, by themselves (a world of one).
def schedule(opt: torch.optim.Optimizer, steps: int) -> list[tuple[int, bool]]:
    p = opt.param_groups[0]["params"][0]
    out = []
    for s in range(1, steps + 1):
        out.append((s, opt.takes_averaged_gradients()))
        p.grad = torch.ones_like(p)
        opt.step()
    return out


def test_one_bit_adam_compresses_after_freeze_step():
    opt = OneBitAdam([torch.nn.Parameter(torch.zeros(4))], freeze_step=3)
    assert [s for s, averaged in schedule(opt, 6) if averaged] == [1, 2, 3]


def test_zero_one_adams_intervals_are_deepspeeds():
    """Variance on multiples of an interval that doubles after every
    var_update_scaler updates, up to step var_freeze_step + 1; then
    synchronisations on multiples of an interval that doubles after
    every local_step_scaler local steps, up to local_step_clipper."""
    p = torch.nn.Parameter(torch.zeros(4))
    opt = ZeroOneAdam([p], var_freeze_step=10, var_update_scaler=2, local_step_scaler=2, local_step_clipper=4)
    averaged = [s for s, a in schedule(opt, 11) if a]
    assert averaged == [1, 2, 4, 6, 8]
    assert opt.phase is Phase.LOCAL and (opt.intervals.var_interval, opt.intervals.var_counter) == (4, 1)
    synchronised = []
    for s in range(12, 30):
        p.grad = torch.ones_like(p)
        opt.step()
        if opt.lr_sums.get(p) is None:  # a synchronisation consumes the learning-rate sum
            synchronised.append(s)
    assert synchronised == [12, 13, 14, 16, 20, 24, 28]
    assert opt.intervals.local_step_interval == 4 and not opt.takes_averaged_gradients()


def test_load_state_dict_restarts_what_deepspeed_restarts():
    p = torch.nn.Parameter(torch.zeros(4))
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0])
    opt = ZeroOneAdam([{"params": [p], "exp_avg_mask": mask}], var_freeze_step=2, local_step_scaler=1)
    schedule(opt, 6)
    saved = opt.state_dict()
    assert set(saved["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    saved["param_groups"][0]["exp_avg_mask"] = torch.zeros(4)  # a mask in a checkpoint is not used
    fresh = ZeroOneAdam([{"params": [p], "exp_avg_mask": mask}], var_freeze_step=2, local_step_scaler=1)
    fresh.load_state_dict(saved)
    assert fresh.steps_taken == 6 and fresh.phase is Phase.LOCAL
    assert fresh.intervals == Intervals() and not fresh.synchronised and not fresh.errors
    assert torch.equal(fresh.param_groups[0]["exp_avg_mask"], mask)


# Configs.
TUTORIAL = {  # deepspeed.ai's 1-bit Adam and 0/1 Adam tutorials
    "OneBitAdam": {"lr": 4e-4, "betas": [0.9, 0.98], "eps": 1e-8, "weight_decay": 0.01, "freeze_step": 23000,
                   "cuda_aware": False, "comm_backend_name": "nccl"},
    "ZeroOneAdam": {"lr": 1e-3, "weight_decay": 0.01, "bias_correction": False, "var_freeze_step": 1000,
                    "var_update_scaler": 16, "local_step_scaler": 1000, "local_step_clipper": 16,
                    "cuda_aware": False, "comm_backend_name": "nccl"},
}


@pytest.mark.parametrize("kind", sorted(TUTORIAL))
def test_deepspeeds_tutorial_configs_are_accepted(kind):
    model = TinyGPT()
    config = {"train_batch_size": 4, "fp16": {"enabled": True},
              "optimizer": {"type": kind.lower(), "params": TUTORIAL[kind]}}
    engine, opt, *_ = zcore.initialize(model=model, config=config)
    assert type(opt.inner).__name__ == kind and opt.inner.param_groups[0]["lr"] == TUTORIAL[kind]["lr"]
    engine.destroy()


@pytest.mark.parametrize(
    "params, match",
    [
        ({"comm_backend_name": "mpi"}, r"comm_backend_name.*MPI implementation.*use 'nccl'"),
        ({"comm_backend_name": "hccl"}, r"comm_backend_name.*Ascend"),
        ({"cuda_aware": True}, r"cuda_aware.*no MPI implementation"),
        ({"eps_inside_sqrt": True}, r"eps_inside_sqrt.*outside the square root"),
        ({"max_grad_norm": 1.0}, r"max_grad_norm.*gradient_clipping"),
        ({"amsgrad": True}, r"optimizer.params.amsgrad"),
        ({"freeze_step": 0}, r"optimizer.params.freeze_step"),
        ({"adam_w_mode": True}, r"unknown key 'optimizer.params.adam_w_mode'"),
        ({"var_freeze_step": 5}, r"unknown key 'optimizer.params.var_freeze_step'"),
    ],
)
def test_keys_that_cannot_work_are_refused_by_name(params, match):
    with pytest.raises(zcore.ConfigError, match=match):
        load_config({"train_batch_size": 4, "optimizer": {"type": "OneBitAdam", "params": params}})


@pytest.mark.parametrize(
    "zero, match",
    [
        ({"stage": 1}, r"zero_optimization.stage is 1.*set zero_optimization.stage to 0"),
        ({"stage": 3}, r"zero_optimization.stage is 3"),
        ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, r"offload_optimizer.device is 'cpu'.*'none'"),
    ],
)
@pytest.mark.parametrize("kind", ["OneBitAdam", "ZeroOneAdam"])
def test_zero_stages_and_offload_are_refused(kind, zero, match):
    config = {"train_batch_size": 4, "optimizer": {"type": kind}, "zero_optimization": zero}
    with pytest.raises(zcore.ConfigError, match=f"{kind}.*{match}"):
        zcore.initialize(model=TinyGPT(), config=config)


def test_a_passed_one_bit_adam_is_refused_under_zero_too():
    config = {"train_batch_size": 4, "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True}
    with pytest.raises(zcore.ConfigError, match=r"OneBitAdam.*zero_optimization.stage is 2"):
        zcore.initialize(model=TinyGPT(), config=config, optimizer=lambda groups: OneBitAdam(groups))


def test_a_momentum_mask_must_fit_its_parameters():
    with pytest.raises(zcore.InvalidArgumentError, match=r"exp_avg_mask has shape \(3,\).*shape \(4,\)"):
        OneBitAdam([{"params": [torch.nn.Parameter(torch.zeros(4))], "exp_avg_mask": torch.ones(3)}])


# Checkpoints.
def checkpoint_round_trip(rank: int, world: int, kind: str, opt: dict, ckpt: Path, saved_at: int) -> dict:
    """Train, save, train on; a new engine loads and trains the same steps.
    The saved run, with its errors and schedule restarted as a load
    restarts them, must continue exactly as the loaded one."""

    def build():
        torch.manual_seed(0)
        model = TinyGPT()
        mask = torch.ones_like(model.wpe.weight)
        mask[8:] = 0  # as for positions never trained (DeepSpeed's example)
        groups = [{"params": [model.wpe.weight], "exp_avg_mask": mask},
                  {"params": [p for n, p in model.named_parameters() if n != "wpe.weight"]}]
        cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": opt}
        return zcore.initialize(model=model, config=cfg, model_parameters=groups)[0]

    def train(engine, steps) -> list[float]:
        losses = []
        for step in steps:
            tokens = sequences(step, rank)
            loss = lm_loss(engine(tokens[:, :-1]), tokens)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses

    first = build()
    train(first, range(saved_at))
    first.save_checkpoint(ckpt)
    inner = first.optimizer.inner
    wpe_state = inner.state[inner.param_groups[0]["params"][0]]
    masked_zero = bool((wpe_state["exp_avg"].view(16, 32)[8:] == 0).all())
    saved_state = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in wpe_state.items()}
    inner.restart_from_loaded_state()
    continued = train(first, range(saved_at, saved_at + 4))
    first.destroy()

    second = build()
    second.load_checkpoint(ckpt)
    inner = second.optimizer.inner
    loaded_state = {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                    for k, v in inner.state[inner.param_groups[0]["params"][0]].items()}
    fresh = not inner.errors and inner.steps_taken == saved_at
    resumed = train(second, range(saved_at, saved_at + 4))
    second.destroy()
    return {"continued": continued, "resumed": resumed, "saved": saved_state, "loaded": loaded_state,
            "fresh": fresh, "masked_zero": masked_zero}


@pytest.mark.parametrize(
    "kind, params, saved_at",
    [
        ("OneBitAdam", {"freeze_step": 3}, 6),  # saved while compressing
        # Local steps from step 4, synchronised on every even step from 6: saved just after one.
        ("ZeroOneAdam", {"var_freeze_step": 2, "local_step_scaler": 2, "local_step_clipper": 2}, 6),
    ],
)
def test_checkpoint_keeps_the_moments_and_restarts_the_error_feedback(tmp_path, kind, params, saved_at):
    results = run_ranks(checkpoint_round_trip, 2, kind, optimizer(kind, **params), tmp_path / "ckpt", saved_at,
                        timeout=180)
    for got in results:
        assert got["fresh"] and got["masked_zero"]
        assert set(got["loaded"]) == {"step", "exp_avg", "exp_avg_sq"} and got["loaded"]["step"] == saved_at
        for key in ("exp_avg", "exp_avg_sq"):
            assert relative_error(got["loaded"][key], got["saved"][key]) == 0.0, key
        assert got["resumed"] == got["continued"]


# Memory: what they keep beside Adam's states.
MEMORY_STEPS = 5
MEMORY_RUNS = {
    "1-bit": optimizer("OneBitAdam", freeze_step=2),  # compresses from step 3
    "0/1": optimizer("ZeroOneAdam", var_freeze_step=2),  # local steps from step 4, each synchronising
}


def actual_extra_bytes(inner) -> int:
    """The bytes of the optimizer's error feedback and synchronised copies, read off the tensors."""
    errors = [t for e in inner.errors.values() for t in (e.worker, e.server)]
    copies = list(getattr(inner, "synchronised", {}).values())
    return sum(t.numel() * t.element_size() for t in errors + copies)


def memory_by_step(rank: int, world: int, opt: dict) -> dict:
    """After each step: the report's measured and theoretical optimizer
    states on the device, Adam's states alone (master and moments), and the
    extra tensors' bytes; then the model's parameters' sizes."""
    torch.manual_seed(0)
    model = TinyGPT()
    engine, *_ = zcore.initialize(model=model, config={"train_micro_batch_size_per_gpu": 2, "optimizer": opt})
    inner = engine.optimizer.inner
    steps = []
    for step in range(MEMORY_STEPS):
        tokens = sequences(step, rank, rows=2)
        engine.backward(lm_loss(engine(tokens[:, :-1]), tokens))
        engine.step()
        report = engine.memory_report()
        steps.append({
            "measured": report.measured_tiers["device"].optimizer_states,
            "theory": report.theoretical_tiers["device"].optimizer_states,
            "adam": engine.optimizer.state_bytes(),
            "extra": actual_extra_bytes(inner),
            "errors": len(inner.errors),
        })
    engine.destroy()
    return {"steps": steps, "numels": [p.numel() for p in model.parameters()]}


@pytest.mark.parametrize("world", [2, 3])  # 3: padding to a multiple of 3 x lcm(3, 8) = 72 per parameter
@pytest.mark.parametrize("label", sorted(MEMORY_RUNS))
def test_the_error_feedback_is_counted_as_optimizer_state(label, world):
    opt = MEMORY_RUNS[label]
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": opt}
    estimate = zcore.estimate_memory(TinyGPT(), config, world, device="cpu").tiers["device"].optimizer_states
    adam = zcore.estimate_memory(TinyGPT(), {**config, "optimizer": optimizer("Adam")}, world,
                                 device="cpu").tiers["device"].optimizer_states
    first_compressed = {"1-bit": 3, "0/1": 4}[label]
    for rank, run in enumerate(run_ranks(memory_by_step, world, opt, timeout=180)):
        numels = run["numels"]
        for step, got in enumerate(run["steps"], start=1):
            where = f"{label}, world {world}, rank {rank}, step {step}: {got}"
            assert got["measured"] == got["adam"] + got["extra"], where
            assert got["theory"] == got["measured"], where
            if step < first_compressed:
                assert got["extra"] == 0, where
                continue
            # Every parameter's worker and server errors, and 0/1 Adam's copies.
            padded = [-(-n // (world * math.lcm(world, 8))) * world * math.lcm(world, 8) for n in numels]
            copies = 4 * sum(numels) if label == "0/1" else 0
            assert got["errors"] == len(numels), where
            assert got["extra"] == 4 * sum(n + n // world for n in padded) + copies, where
        # The estimate: Adam's states and, from the first compressed step on, these.
        final = run["steps"][-1]
        assert estimate - adam == final["extra"], (label, world, rank)
        assert estimate == final["measured"], (label, world, rank)
