"""Training loops shared by the engine tests: zcore on N ranks, and a plain
single-process reference over the same global batches.

A global batch of GLOBAL_BATCH rows (or the config's train_batch_size) is split into world x accumulation parts;
part q = m * world + r is rank r's micro-batch m. The reference computes the
same parts in one process, accumulates their fp32 gradients and steps
torch.optim.AdamW on fp32 master weights (in fp32 training the master is the
model itself), on the device the engine ran on (tests/python/devices.py).
"""

from __future__ import annotations

import copy
from typing import Callable, Optional

import torch
import torch.distributed as dist

import zcore
from devices import BACKENDS
from models import forward, global_batch, loss_of, make_model, takes_tokens

GLOBAL_BATCH = 8
LR = 3e-3
WEIGHT_DECAY = 0.01
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FP16_SCALE_POWER = 8  # small enough that these models never overflow
# Stage 3: no group stays gathered between uses; and a tight live budget
# (a block of the tiny GPT has 12.6k parameters).
ON_DEMAND = {"stage3_param_persistence_threshold": 0}
LIVE, BUCKET = 6000, 3000
TIGHT = {**ON_DEMAND, "stage3_max_live_parameters": LIVE, "stage3_prefetch_bucket_size": BUCKET,
         "stage3_max_reuse_distance": 0}


def zcore_config(
    stage: int,
    gas: int,
    clip: float,
    precision: str = "fp32",
    offload: bool = False,
    zero: Optional[dict] = None,
    **extra,
) -> dict:
    """``zero``: more zero_optimization keys; ``extra``: more top-level keys."""
    config = {
        "train_batch_size": GLOBAL_BATCH,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
        # Small buckets: several units per model, so ordering and overlap matter.
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 3000,
            "offload_optimizer": {"device": "cpu" if offload else "none"},
            **(zero or {}),
        },
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": FP16_SCALE_POWER}
    return {**config, **extra}


def rows(part: int, parts: int, batch: int = GLOBAL_BATCH) -> slice:
    micro = batch // parts
    return slice(part * micro, (part + 1) * micro)


def train_zcore(
    rank: int, world: int, model_name: str, config: dict, steps: int, inspect: Optional[Callable] = None
) -> dict:
    """Trains on this rank's parts of each global batch, on the engine's
    device; returns the mean loss per step (over ranks and micro-steps), the
    final parameters in fp32 on the CPU, the engine's device and memory
    report and what ``inspect(engine)`` returns; then destroys the engine
    (its swap files)."""
    engine, _, _, _ = zcore.initialize(model=make_model(model_name), config=config)
    gas = engine.gradient_accumulation_steps()
    batch = engine.train_batch_size()
    dtype = engine.optimizer.precision.compute_dtype
    device = engine.context.device
    losses = []
    for step in range(steps):
        x, y = global_batch(model_name, step, batch)
        total = torch.zeros((), device=device)
        for m in range(gas):
            part = rows(m * world + rank, world * gas, batch)
            xs = x[part] if takes_tokens(model_name) else x[part].to(dtype)
            out = forward(model_name, engine, xs.to(device), step, rank)
            loss = loss_of(model_name, out, y[part].to(device))
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        dist.all_reduce(total)
        losses.append(total.item() / (world * gas))
    gather_stats = engine.gather_stats()  # before the gathering below
    with zcore.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().float().cpu().clone() for n, p in engine.module.named_parameters()}
    inspected = None if inspect is None else inspect(engine)
    memory = engine.memory_report()
    engine.destroy()
    return {
        "losses": losses,
        "params": params,
        "device": (device.type, engine.context.backend),
        "global_steps": engine.global_steps,
        "skipped_steps": engine.skipped_steps,
        "memory": memory,
        "inspected": inspected,
        "optimizer": type(engine.optimizer.inner).__name__,
        "update": type(engine.optimizer.update).__name__,
        "gather_stats": gather_stats,
    }


def train_reference(
    model_name: str,
    clip: float,
    steps: int,
    world: int,
    gas: int,
    precision: str = "fp32",
    batch: int = GLOBAL_BATCH,
    device: str = "cpu",
) -> dict:
    master = make_model(model_name).to(device)
    dtype = DTYPES[precision]
    model = master if dtype == torch.float32 else copy.deepcopy(master).to(dtype)
    pairs = [(mp, cp) for mp, cp in zip(master.parameters(), model.parameters()) if mp.requires_grad]
    opt = torch.optim.AdamW([mp for mp, _ in pairs], lr=LR, weight_decay=WEIGHT_DECAY)
    scale = 2.0**FP16_SCALE_POWER if precision == "fp16" else 1.0
    parts = world * gas
    losses = []
    for step in range(steps):
        x, y = global_batch(model_name, step, batch)
        total = 0.0
        for q in range(parts):
            part = rows(q, parts, batch)
            xs = x[part] if takes_tokens(model_name) else x[part].to(dtype)
            out = forward(model_name, model, xs.to(device), step, rank=q % world)
            loss = loss_of(model_name, out, y[part].to(device))
            (loss * (scale / parts)).backward()
            total += loss.item()
            if model is not master:  # accumulate in fp32, as zcore does
                for mp, cp in pairs:
                    if cp.grad is not None:
                        g = cp.grad.float()
                        mp.grad = g if mp.grad is None else mp.grad + g
                        cp.grad = None
        for mp, _ in pairs:
            if mp.grad is not None:
                mp.grad /= scale
        if clip > 0:
            torch.nn.utils.clip_grad_norm_([mp for mp, _ in pairs], clip)
        opt.step()
        opt.zero_grad()
        if model is not master:
            with torch.no_grad():
                for mp, cp in pairs:
                    cp.copy_(mp)
        losses.append(total / parts)
    params = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params}


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def assert_matches(
    got: dict, ref: dict, loss_tolerance: float, label: str, param_tolerance: float | None = None
) -> None:
    param_tolerance = loss_tolerance if param_tolerance is None else param_tolerance
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"], strict=True)):
        assert abs(a - b) <= loss_tolerance * abs(b), f"{label}: step {step} loss {a} vs {b}"
    assert got["params"].keys() == ref["params"].keys(), label
    for name, value in got["params"].items():
        err = relative_error(value, ref["params"][name])
        assert err <= param_tolerance, f"{label}: parameter {name} off by {err:.2e}"


# The optimizer update each offload setting of a variant gets.
UPDATES = {False: "TorchUpdate", True: "FusedCpuUpdate", "nvme": "SwappedAdamUpdate"}


def assert_variants_match(
    results: list[dict], variants: list[tuple], world: int, steps: int, batch: int,
    tolerance: float, param_tolerance: float, device: str = "cpu",
) -> None:
    """``results[rank][label]`` from train_zcore for each variant (label,
    model, accumulation, clipping, optimizer on the host, ...): rank 0's
    losses and parameters against the single-process reference on
    ``device``, and every rank's final parameters identical to rank 0's."""
    for label, model, gas, clip, offload, *_ in variants:
        got = results[0][label]
        ref = train_reference(model, clip, steps, world, gas, batch=batch, device=device)
        tag = f"{label} world {world} on {device}"
        assert got["device"] == (device, BACKENDS[device]), tag
        assert got["global_steps"] == steps and got["skipped_steps"] == 0, tag
        assert got["update"] == UPDATES[offload], tag
        assert_matches(got, ref, tolerance, tag, param_tolerance)
        for other in results[1:]:
            for name, value in other[label]["params"].items():
                assert relative_error(value, got["params"][name]) == 0.0, tag
