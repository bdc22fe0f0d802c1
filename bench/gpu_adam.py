"""Multi-tensor CUDA Adam: zcore vs torch.optim.AdamW(fused=True), with the
device's copy bandwidth measured in the same run.

--numel parameters (default 1B) are split into --tensors tensors of
geometrically spread sizes (a model's mix of large and small). Two steps:
  fp32   params, grads, states fp32 (28 bytes/param moved);
  mixed  fp32 master and states, bf16 grads in, bf16 params out (zcore: one
         launch, 28 bytes/param; torch: its fused AdamW on fp32 grads cast
         from bf16, then the params cast to bf16).
GB/s counts 28 bytes per parameter; the ceiling is a device-to-device copy
(cudaMemcpy of a 4 GiB buffer: read + write bytes per second). Medians of
--repeats CUDA-event-timed steps. Needs a GPU with ~(numel * 34) bytes free.

    python bench/gpu_adam.py [--numel 1000000000] [--tensors 200] [--repeats 10]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

import zcore
import zcore.optim as zo

BYTES_PER_PARAM = 28
LR, WD = 1e-3, 0.01
CONFIG = zo.AdamConfig(lr=LR, weight_decay=WD, decoupled_weight_decay=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=1_000_000_000)
    parser.add_argument("--tensors", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=10)
    return parser.parse_args()


def sizes(numel: int, count: int) -> list[int]:
    weights = [1.05**i for i in range(count)]
    total = sum(weights)
    out = [max(1, int(numel * w / total)) for w in weights]
    out[-1] += numel - sum(out)
    return out


def timed(run: Callable[[], None], repeats: int) -> float:
    run()  # warm-up (torch allocates its states)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_bandwidth(repeats: int) -> float:
    src = torch.empty(1 << 30, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), repeats)
    return 2 * src.numel() * 4 / seconds / 1e9


def zcore_run(shapes: list[int], grad_dtype: torch.dtype, out_dtype: torch.dtype | None) -> Callable[[], None]:
    params = [torch.randn(n, device="cuda") * 0.02 for n in shapes]
    grads = [(torch.randn(n, device="cuda") * 1e-3).to(grad_dtype) for n in shapes]
    exp_avgs = [torch.zeros(n, device="cuda") for n in shapes]
    exp_avg_sqs = [torch.zeros(n, device="cuda") for n in shapes]
    outs = None if out_dtype is None else [torch.empty(n, device="cuda", dtype=out_dtype) for n in shapes]
    step = [0]

    def run() -> None:
        step[0] += 1
        zo.adam_step(CONFIG, step[0], params, grads, exp_avgs, exp_avg_sqs, params_out=outs)

    return run


def torch_run(shapes: list[int], mixed: bool) -> Callable[[], None]:
    params = [(torch.randn(n, device="cuda") * 0.02).requires_grad_() for n in shapes]
    low_grads = [(torch.randn(n, device="cuda") * 1e-3).to(torch.bfloat16) for n in shapes]
    for p, g in zip(params, low_grads):
        p.grad = g.float()
    outs = [torch.empty(n, device="cuda", dtype=torch.bfloat16) for n in shapes] if mixed else []
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD, fused=True)

    def run() -> None:
        if mixed:
            torch._foreach_copy_([p.grad for p in params], low_grads)
        opt.step()
        if mixed:
            torch._foreach_copy_(outs, [p.detach() for p in params])

    return run


def main() -> None:
    args = parse_args()
    if not zcore.cuda_available():
        raise SystemExit(f"no usable GPU: {zcore.cuda_unavailable_reason()}")
    shapes = sizes(args.numel, args.tensors)
    ceiling = copy_bandwidth(args.repeats)
    results: list[tuple[str, str, float]] = []
    for step_name, mixed in (("fp32", False), ("mixed bf16", True)):
        for name, make in (
            ("zcore", lambda: zcore_run(shapes, torch.bfloat16 if mixed else torch.float32,
                                        torch.bfloat16 if mixed else None)),
            ("torch AdamW fused" + (" + casts" if mixed else ""), lambda: torch_run(shapes, mixed)),
        ):
            run = make()
            results.append((step_name, name, timed(run, args.repeats)))
            del run
            torch.cuda.empty_cache()
    print(f"CUDA Adam on {torch.cuda.get_device_name()}, {args.numel:,} params in {args.tensors} tensors, "
          f"median of {args.repeats}")
    print("| step | contender | median ms | GB/s (28 B/param) | % of copy bandwidth |")
    print("| --- | --- | ---: | ---: | ---: |")
    for step_name, name, seconds in results:
        gbs = BYTES_PER_PARAM * args.numel / seconds / 1e9
        print(f"| {step_name} | {name} | {seconds * 1e3:.2f} | {gbs:.0f} | {100 * gbs / ceiling:.0f}% |")
    print(f"| - | device copy (read+write) | - | {ceiling:.0f} | 100% |")


if __name__ == "__main__":
    main()
