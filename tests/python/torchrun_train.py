"""Trained by test_torchrun.py under torch's own launcher (env://)."""

import torch
import torch.distributed as dist

import zcore
from zcore.demo.train import exit_now

engine, _, _, _ = zcore.initialize(
    model=torch.nn.Linear(8, 2),
    config={"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"},
            "zero_optimization": {"stage": 2}},
)
for step in range(3):
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(step + 10 * dist.get_rank()))
    engine.backward(engine(x).pow(2).mean())
    engine.step()
weights = [torch.empty(18) for _ in range(dist.get_world_size())]
dist.all_gather(weights, torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()]))
assert all(torch.equal(w, weights[0]) for w in weights), "ranks disagree"
print(f"rank {dist.get_rank()} of {dist.get_world_size()} ({engine.context.backend}): {engine.global_steps} steps")
dist.barrier()
dist.destroy_process_group()
exit_now()  # skips the gloo static-teardown abort of torch 2.13 (see zcore.demo.train)
