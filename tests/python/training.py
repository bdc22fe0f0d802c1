"""Training loops shared by the engine tests: zcore on N ranks, and the plain
single-process reference over the same global batches."""

from __future__ import annotations

import torch
import torch.distributed as dist

import zcore
from models import global_batch, loss_of, make_model

GLOBAL_BATCH = 8
LR = 1e-2
WEIGHT_DECAY = 0.01


def zcore_config(stage: int, gas: int, clip: float, **extra) -> dict:
    return {
        "train_batch_size": GLOBAL_BATCH,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
        # Small buckets: several units per model, so ordering and overlap matter.
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000},
        **extra,
    }


def train_zcore(rank: int, world: int, model_name: str, config: dict, steps: int) -> dict:
    """Trains on this rank's share of each global batch; returns the mean loss
    per step (over ranks and micro-steps) and the final parameters in fp32."""
    engine, _, _, _ = zcore.initialize(model=make_model(model_name), config=config)
    gas = engine.gradient_accumulation_steps()
    micro = engine.train_micro_batch_size_per_gpu()
    dtype = engine.optimizer.precision.compute_dtype
    losses = []
    for step in range(steps):
        x, y = global_batch(model_name, step, GLOBAL_BATCH)
        total = torch.zeros(())
        for m in range(gas):
            rows = slice((m * world + rank) * micro, (m * world + rank + 1) * micro)
            xs = x[rows] if model_name == "gpt" else x[rows].to(dtype)
            loss = loss_of(model_name, engine(xs), y[rows])
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        dist.all_reduce(total)
        losses.append(total.item() / (world * gas))
    params = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    return {"losses": losses, "params": params, "engine_steps": engine.global_steps}


def train_reference(model_name: str, clip: float, steps: int) -> dict:
    model = make_model(model_name)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
    losses = []
    for step in range(steps):
        x, y = global_batch(model_name, step, GLOBAL_BATCH)
        loss = loss_of(model_name, model(x), y)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))
