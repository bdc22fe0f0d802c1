"""ZeRO-3 beyond the training loop: generation on ranks that finish at
different lengths, GatheredParameters, an evaluation under
torch.inference_mode() before training, construction on the meta device, the
saved-tensor hooks that keep backward reading the right bytes, departures
from the trace, and a forward that fails. Generation and GatheredParameters
at world 1 run on ZCORE_TEST_DEVICE (NCCL on a GPU)."""


import pytest
import torch
import torch.distributed as dist
from torch import nn

import devices
import zcore
from distributed import run_ranks
from log_capture import capture_zcore_log
from models import TinyGPT, make_model
from zcore.demo.gpt import _init_weights as init_weights

PROMPTS = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]])
NEW_TOKENS = 20
# Per sample: stop after this many new tokens (or at STOP), so samples, and
# the ranks holding them, finish at different lengths.
LIMITS = [7, 20, 12, 3]
STOP = 0
ON_DEMAND = {"stage3_param_persistence_threshold": 0}


def stage3_config(**zero):
    return {
        "train_batch_size": 4,
        "gradient_clipping": 0.0,  # the references are torch's AdamW alone
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, **ON_DEMAND, **zero},
    }


def generate(forward, prompts, limits, seq_len, keep_going=lambda done: not done):
    """Greedy decoding with a per-sample stop; ``keep_going(all_done_here)``
    decides whether to run another forward (ranks in lockstep)."""
    tokens = prompts.clone()
    lengths = [prompts.shape[1]] * len(prompts)
    done = torch.zeros(len(prompts), dtype=torch.bool)
    new = 0
    with torch.no_grad():
        while keep_going(bool(done.all())) and new < NEW_TOKENS:
            logits = forward(tokens[:, -seq_len:])
            nxt = logits[:, -1].argmax(-1)
            tokens = torch.cat([tokens, nxt[:, None]], dim=1)
            new += 1
            for i in range(len(prompts)):
                if not done[i]:
                    lengths[i] += 1
                    done[i] = bool(nxt[i] == STOP) or new >= limits[i]
    return [row[:n].tolist() for row, n in zip(tokens, lengths)]


def generation_and_gathering(rank, world, device):
    on = devices.init_process_group(device)
    engine, *_ = zcore.initialize(model=make_model("gpt"), config=stage3_config())
    devices.assert_on(engine, device)
    engine.eval()
    seq_len = engine.module.cfg.seq_len
    mine = slice(2 * rank, 2 * rank + 2)

    def any_rank_busy(done_here):
        busy = torch.tensor([0 if done_here else 1], device=on)
        dist.all_reduce(busy)
        return bool(busy.item())

    out = {"tokens": generate(engine, PROMPTS[mine].to(on), LIMITS[mine], seq_len, any_rank_busy)}
    stats = engine.gather_stats()
    out["leak"] = (stats.gathered_bytes, stats.persistent_bytes, engine.residency.coordinator.in_step)

    wpe = engine.module.wpe.weight
    out["sharded_shape"] = tuple(wpe.shape)
    with zcore.GatheredParameters([wpe]):
        out["read"] = wpe.detach().cpu().clone()
    with zcore.GatheredParameters([wpe], modifier_rank=0):
        wpe.data.fill_(float(rank + 1))  # only rank 0's value may survive
    with zcore.GatheredParameters(wpe):
        out["modified"] = wpe.detach().cpu().clone()
    group = engine.residency.group_of_param[id(wpe)]
    unit = engine.optimizer.units.index(engine.residency.groups[group])
    out["master"] = engine.optimizer.master.shards[unit].cpu().clone()
    out["local_shard"] = engine.residency.groups[group].local_shard.cpu().clone()
    return out


@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.device), 2])
def test_generation_and_gathered_parameters(world, device):
    results = run_ranks(generation_and_gathering, world, device, launcher=world > 1, timeout=300)
    model = make_model("gpt").eval()
    for rank, got in enumerate(results):
        mine = slice(2 * rank, 2 * rank + 2)
        expected = generate(model, PROMPTS[mine], LIMITS[mine], model.cfg.seq_len)
        assert got["tokens"] == expected, rank
        assert got["leak"] == (0, 0, False), rank
        assert got["sharded_shape"] == (0,), rank
        assert torch.equal(got["read"], model.wpe.weight.detach()), rank
        assert torch.equal(got["modified"], torch.ones_like(got["modified"])), rank
        assert torch.equal(got["master"], got["local_shard"]) and bool((got["master"] == 1).all())
    assert len({len(t) for r in results for t in r["tokens"]}) > world  # lengths differ


def evaluate_then_train(rank, world, nvme):
    """The engine's first forwards run under torch.inference_mode(), with the
    default persistence threshold: the small groups they gather stay
    gathered for the training forwards that follow."""
    zero = {"stage": 3}
    if nvme:
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme, "max_in_cpu": 0}
    config = {**stage3_config(), "zero_optimization": zero}
    engine, *_ = zcore.initialize(model=make_model("gpt"), config=config)
    x, y = PROMPTS[2 * rank : 2 * rank + 2, :3], PROMPTS[2 * rank : 2 * rank + 2, 1:]
    with torch.inference_mode():
        evaluated = engine(x).float()
    losses = []
    for _ in range(3):
        loss = nn.functional.cross_entropy(engine(x).flatten(0, 1), y.flatten())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.destroy()
    return evaluated, losses


@pytest.mark.parametrize("nvme", [False, True])
def test_an_evaluation_under_inference_mode_before_training(nvme, tmp_path):
    results = run_ranks(evaluate_then_train, 2, str(tmp_path) if nvme else None, timeout=300)
    model = make_model("gpt")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with torch.inference_mode():
        for rank, (evaluated, _) in enumerate(results):
            assert torch.allclose(evaluated, model(PROMPTS[2 * rank : 2 * rank + 2, :3]), atol=1e-6), rank
    x, y = PROMPTS[:, :3], PROMPTS[:, 1:]
    for step in range(3):
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = sum(r[1][step] for r in results) / 2
        assert abs(mean - loss.item()) <= 1e-5 * loss.item(), step


class PartlyUsed(nn.Linear):
    """A linear layer with a trained parameter that its forward leaves out:
    when its input takes no gradient, its backward is over only at the end
    of backward (not all of its gradients come)."""

    def __init__(self) -> None:
        super().__init__(8, 8)
        self.unused = nn.Parameter(torch.zeros(8))


class TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = PartlyUsed()

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(z)


def saved_views(rank, world, with_hooks):
    torch.manual_seed(0)
    model = TwoLinears()
    reference = TwoLinears()
    reference.load_state_dict(model.state_dict())
    # Forward: a is gathered into the arena's first block, released, and b
    # takes the same block. Backward: b is gathered first (into that block)
    # and stays until the end (its input z takes no gradient and its unused
    # parameter none either), so a comes back elsewhere; a view of a's weight
    # saved at forward would read b's.
    config = stage3_config(stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0)
    engine, *_ = zcore.initialize(model=model, config=config)
    if not with_hooks:
        fetcher = engine.residency
        fetcher.pack = fetcher.unpack = lambda t: t  # what autograd does without them
    x, z = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8)
    engine.backward(engine(x, z).square().sum())
    xr = x.detach().clone().requires_grad_()
    reference(xr, z).square().sum().backward()
    return x.grad, xr.grad


def test_saved_parameter_views_follow_their_group():
    got, want = run_ranks(saved_views, 1, True, launcher=False)[0]
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)
    # The scenario is one that breaks without the hooks.
    got, want = run_ranks(saved_views, 1, False, launcher=False)[0]
    assert not torch.allclose(got, want, rtol=1e-3, atol=1e-4)


def full_bytes(model):
    """Bytes of parameters that hold real values now (not meta, not sharded away)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)


def built_on_meta(rank, world):
    with torch.device("meta"):
        model = TinyGPT()
    peak = []
    total = sum(p.numel() * p.element_size() for p in model.parameters())

    def init(module):
        peak.append(full_bytes(model))
        init_weights(module)

    meta_init = zcore.MetaInit(init_fn=init, seed=7)
    engine, *_ = zcore.initialize(model=model, config=stage3_config(), meta_init=meta_init)
    with zcore.GatheredParameters(list(model.parameters())):
        values = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = PROMPTS
    with torch.no_grad():
        logits = engine(x)
    return {"values": values, "logits": logits, "peak": max(peak), "total": total,
            "tied": model.lm_head.weight is model.wte.weight}


def test_a_meta_model_is_built_shard_by_shard():
    results = run_ranks(built_on_meta, 2, timeout=300)
    reference = TinyGPT()
    seeds = zcore.MetaInit(seed=7)
    done = set()
    for name, module in reference.named_modules():  # zcore's contract: one seed per owning module
        own = [p for p in module.parameters(recurse=False) if id(p) not in done]
        if own:
            done.update(id(p) for p in own)
            torch.manual_seed(seeds.module_seed(name))
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
            init_weights(module)
    with torch.no_grad():
        expected = reference(PROMPTS)
    for got in results:
        assert got["tied"]
        for name, value in reference.named_parameters():
            assert torch.equal(got["values"][name], value.detach()), name
        assert torch.allclose(got["logits"], expected, rtol=1e-5, atol=1e-6)
        # Never whole: at most one module's parameters had full values at a time.
        assert got["peak"] < got["total"] // 4


def departures_and_failures(rank, world):
    messages = capture_zcore_log()
    engine, *_ = zcore.initialize(model=make_model("mix"), config=stage3_config())
    x = torch.randn(4, 16)

    def train_step(branch):
        engine.backward(engine(x, use_branch=branch).square().mean())
        engine.step()

    for step in range(6):  # the branch alternates: every step after the first departs
        train_step(branch=step % 2 == 0)
    try:
        engine(torch.randn(4, 3))  # fails inside the first layer, its group gathered
    except RuntimeError:
        failed = True
    stats = engine.gather_stats()
    after_failure = (failed, stats.gathered_bytes, engine.residency.coordinator.in_step)
    train_step(branch=True)
    return {
        "notices": [m for m in messages.messages if "left its recorded module order" in m],
        "departures": stats.trace_departures,
        "after_failure": after_failure,
        "aborted": engine.residency.coordinator.stats().aborted_steps,
        "gathered_at_end": engine.gather_stats().gathered_bytes,
    }


def test_departures_are_logged_once_and_a_failed_forward_releases_everything():
    got = run_ranks(departures_and_failures, 1, launcher=False)[0]
    assert got["departures"] >= 4 and len(got["notices"]) == 1
    assert got["after_failure"] == (True, 0, False) and got["aborted"] == 1
    assert got["gathered_at_end"] == 0



class ScaledInPlace(nn.Module):
    """Changes a hooked module's output in place; the caller then changes
    the root's output in place, as transformers' Trainer does to the loss
    (``loss *= ...``)."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        h = self.inner(x)
        h *= 2.0
        return self.head(h).square().mean()


def in_place_gradient_norms(rank, world):
    torch.manual_seed(0)
    model = ScaledInPlace()
    reference = ScaledInPlace()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(4, 8)  # the same on every rank: the mean gradient is this one's
    loss = reference(x)
    loss *= 3.0
    loss.backward()
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()])).item()
    # A clipping threshold never reached makes the step compute the norm.
    config = {**stage3_config(), "train_batch_size": 4 * world, "gradient_clipping": 1e9}
    engine, *_ = zcore.initialize(model=model, config=config)
    loss = engine(x)
    loss *= 3.0
    engine.backward(loss)
    engine.step()
    return engine.last_grad_norm, expected


def test_outputs_changed_in_place_keep_their_gradients():
    """Autograd refused in-place changes to the outputs zcore's backward
    hooks passed on (views of a multi-output Function)."""
    for got, expected in run_ranks(in_place_gradient_norms, 2, timeout=120):
        assert got == pytest.approx(expected, rel=1e-5)
