"""Host overhead of ZeRO-3's hooks and coordinator per module call, on a deep
model of tiny layers where it dominates: the same training step with plain
torch (no sharding), zcore stage 3, FSDP2 (``fully_shard`` on every layer and
the model) and DeepSpeed stage 3, on a world of one (no communication), and
the difference to plain torch per module call (forward and backward each
call a module's hooks once). Every system steps torch.optim.AdamW, so they
differ only in their hooks and bookkeeping. Each system runs in a fresh
process (DeepSpeed patches torch when imported).

    python bench/zero3_hook_overhead.py [--layers 256] [--steps 50]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from _ranks import run_local_ranks

# label -> (system, stage3_param_persistence_threshold)
SYSTEMS = {
    "plain torch (no sharding)": ("plain", None),
    "zcore stage 3, groups gathered/released": ("zcore", 0),
    "zcore stage 3, all persistent": ("zcore", 10**9),
    "FSDP2, fully_shard per layer": ("fsdp2", None),
    "DeepSpeed stage 3, gathered/released": ("deepspeed", 0),
    "DeepSpeed stage 3, all persistent": ("deepspeed", 10**9),
}
MICRO_BATCH = 4


def _model(layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)])


def _build(system: str, threshold, model: nn.Module):
    """(forward, backward, step) for one system."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def torch_step():
        opt.step()
        opt.zero_grad(set_to_none=True)

    if system == "plain":
        return model, lambda loss: loss.backward(), torch_step
    if system == "fsdp2":
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo")
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # over the sharded parameters
        return model, lambda loss: loss.backward(), torch_step
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": threshold},
        "zero_allow_untested_optimizer": True,
    }
    if system == "zcore":
        import zcore

        engine, *_ = zcore.initialize(model=model, config=config, optimizer=opt)
    else:
        import deepspeed

        engine, *_ = deepspeed.initialize(model=model, config=config, optimizer=opt)
    return engine, engine.backward, engine.step


def _timed(rank: int, world: int, system: str, threshold, layers: int, steps: int) -> float:
    """The median step time (s) of one system, after two untimed steps."""
    forward, backward, step = _build(system, threshold, _model(layers))
    x = torch.randn(MICRO_BATCH, 8)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        backward(forward(x).square().mean())
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=256)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()

    rows = []  # (label, median step s, or {"error": ...})
    for label, (system, threshold) in SYSTEMS.items():
        result = run_local_ranks(_timed, 1, system, threshold, args.layers, args.steps, timeout=600)
        rows.append((label, result if isinstance(result, dict) else result[0]))

    t_plain = rows[0][1]
    calls = 2 * args.layers  # each layer's hooks run in forward and in backward
    print(f"{args.layers} layers of Linear(8, 8), micro-batch {MICRO_BATCH}, 1 thread, world size 1, "
          f"torch AdamW, median of {args.steps - 2} steps")
    print(f"{'':44}{'step ms':>10}{'overhead us per module call':>30}")
    for label, t in rows:
        if isinstance(t, dict):
            print(f"{label:44}  failed: {t['error']}")
            continue
        overhead = "-" if isinstance(t_plain, dict) else f"{(t - t_plain) / calls * 1e6:.1f}"
        print(f"{label:44}{t * 1e3:>10.2f}{overhead:>30}")


if __name__ == "__main__":
    main()
