"""Muon on the host: zcore's Newton-Schulz (torch's matmul, in bfloat16, as
zcore runs it on a matrix's owner rank with the optimizer offloaded) and
zcore's whole Muon step, against torch.optim.Muon's step on the same matrices;
and DeepSpeed's Gram Newton-Schulz (``ns_method: "gram"``, fp16), as zcore runs it.

The matrices are one transformer block's (d x 3d, d x d, 4d x d, d x 4d for
--width d). Contenders run round-robin, --repeats times each, so that a
noisy (shared) machine slows them alike; the table gives median wall times
and the Newton-Schulz share of the step. zcore has no native Newton-Schulz:
its iteration is torch's bfloat16 matmul (oneDNN on the CPU), which a
native kernel would have to beat to be worth its bits.

    .venv/bin/python bench/muon_step.py [--width 1024] [--threads 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from zcore.optim.muon import Muon, gram_newton_schulz, newton_schulz

LR, WD = 0.02, 0.01


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    return parser.parse_args()


def block_shapes(d: int) -> list[tuple[int, int]]:
    return [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)]


def params_with_grads(shapes: list[tuple[int, int]]) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    return params


def contenders(shapes: list[tuple[int, int]]) -> dict[str, Callable[[], None]]:
    grads = [torch.randn(s) * 1e-3 for s in shapes]
    theirs = params_with_grads(shapes)
    ours = params_with_grads(shapes)
    gram = params_with_grads(shapes)
    torch_muon = torch.optim.Muon(theirs, lr=LR, weight_decay=WD)
    zcore_muon = Muon(ours, lr=LR, weight_decay=WD)
    zcore_gram = Muon(gram, lr=LR, weight_decay=WD, ns_method="gram")
    return {
        "zcore newton_schulz (torch matmul)": lambda: [newton_schulz(g) for g in grads],
        "zcore gram_newton_schulz (fp16)": lambda: [gram_newton_schulz(g) for g in grads],
        "zcore Muon.step": zcore_muon.step,
        "zcore Muon.step, ns_method gram": zcore_gram.step,
        "torch.optim.Muon.step": torch_muon.step,
    }


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    shapes = block_shapes(args.width)
    runs = contenders(shapes)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():  # warm-up
        run()
    for _ in range(args.repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    torch_step = statistics.median(times["torch.optim.Muon.step"])
    print(f"Muon on the host: matrices {shapes}, {args.threads} threads, median of {args.repeats}")
    print(f"{'contender':<38} {'ms':>10} {'vs torch step':>14}")
    for name, samples in times.items():
        ms = statistics.median(samples) * 1e3
        print(f"{name:<38} {ms:>10.1f} {ms / (torch_step * 1e3):>13.2f}x")


if __name__ == "__main__":
    main()
