"""Host overhead of ZeRO-3's hooks and coordinator per module call, on a deep
model of tiny layers where it dominates: the same training step with plain
torch (no sharding) and with zcore stage 3 on a world of one (no
communication), and the difference per module call (forward and backward
each call a module's hooks once).

    python bench/zero3_hook_overhead.py [--layers 256] [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import zcore


def model(layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)])


def timed_steps(forward, backward, step, steps: int) -> float:
    x = torch.randn(4, 8)
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
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)

    plain = model(args.layers)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)

    def plain_step():
        opt.step()
        opt.zero_grad(set_to_none=True)

    t_plain = timed_steps(plain, lambda loss: loss.backward(), plain_step, args.steps)

    rows = [("plain torch (no sharding)", t_plain)]
    for label, threshold in (("zcore stage 3, groups gathered/released", 0), ("zcore stage 3, all persistent", 10**9)):
        engine, *_ = zcore.initialize(
            model=model(args.layers),
            config={
                "train_micro_batch_size_per_gpu": 4,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": threshold},
            },
        )
        rows.append((label, timed_steps(engine, engine.backward, engine.step, args.steps)))

    calls = 2 * args.layers  # each layer's hooks run in forward and in backward
    print(f"{args.layers} layers of Linear(8, 8), micro-batch 4, 1 thread, world size 1, median of {args.steps - 2} steps")
    print(f"{'':44}{'step ms':>10}{'overhead us per module call':>30}")
    for label, t in rows:
        overhead = (t - t_plain) / calls * 1e6
        print(f"{label:44}{t * 1e3:>10.2f}{overhead:>30.1f}")


if __name__ == "__main__":
    main()
