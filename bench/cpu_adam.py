"""Fused CPU Adam: zcore vs torch.optim.AdamW (foreach, fused) and DeepSpeed's
DeepSpeedCPUAdam, with a memory-bandwidth ceiling measured in the same run.

Two steps are timed on one flat buffer of --numel parameters, --threads threads:
  fp32   params, grads, exp_avg, exp_avg_sq all fp32 (28 bytes/param moved);
  mixed  the offload step: bf16 grads in, fp32 master and states updated, bf16
         params out (zcore: one pass, also 28 bytes/param; the others: cast
         the grads to fp32, step, cast the params to bf16).
Contenders run round-robin, --repeats times each, so that a noisy (shared)
machine slows them alike; the table gives medians, of wall time and of the
process's CPU time (all threads: on a loaded machine, wall time also counts
the time the threads waited for a core). GB/s counts 28 bytes per
parameter for every contender (what the step must move at least). The
ceiling is BM_AdamPatternCeiling of bench/cpp/bench_adam (the same 4-read,
3-write pattern with trivial arithmetic, same thread count).

    .venv/bin/python bench/cpu_adam.py [--numel 100000000] [--threads 2] [--repeats 7]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

import zcore.optim as zo

BYTES_PER_PARAM = 28
CEILING_NUMEL = 100_000_000  # the size bench_adam registers its ceiling loop for
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01
ROOT = Path(__file__).resolve().parent.parent


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=100_000_000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeedCPUAdam")
    parser.add_argument("--ceiling-binary", type=Path, default=ROOT / "build/py/bench/cpp/bench_adam")
    return parser.parse_args()


def master_weights(n: int) -> torch.Tensor:
    return torch.randn(n) * 0.02


def gradients(n: int) -> torch.Tensor:
    return torch.randn(n) * 1e-3


def zcore_step(n: int, grads: torch.Tensor, out: torch.Tensor | None) -> Callable[[], None]:
    p, m, v = master_weights(n), torch.zeros(n), torch.zeros(n)
    config = zo.AdamConfig(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, decoupled_weight_decay=True)
    step = [0]

    def run() -> None:
        step[0] += 1
        zo.adam_step_flat(config, step[0], p, grads, m, v, params_out=out)

    return run


def optimizer_step(make: Callable[[list[torch.Tensor]], torch.optim.Optimizer], n: int,
                   grads: torch.Tensor, low: tuple[torch.Tensor, torch.Tensor] | None) -> Callable[[], None]:
    """A torch-style optimizer on one fp32 parameter. With ``low`` = (bf16
    grads, bf16 params out): cast the grads in, step, cast the params out."""
    p = master_weights(n).requires_grad_()
    p.grad = grads
    opt = make([p])

    def run() -> None:
        if low is not None:
            p.grad.copy_(low[0])
        opt.step()
        if low is not None:
            low[1].copy_(p.detach())

    return run


def load_deepspeed(report: list[str]) -> type | None:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        from deepspeed.ops.op_builder import CPUAdamBuilder
    except ImportError as e:
        report.append(f"DeepSpeed not installed ({e}); pip install deepspeed==0.19.8")
        return None
    start = time.perf_counter()
    CPUAdamBuilder().load()
    report.append(f"DeepSpeed cpu_adam op load (JIT build on first use, cached after): "
                  f"{time.perf_counter() - start:.1f} s")
    return DeepSpeedCPUAdam


def time_round_robin(contenders: dict[str, Callable[[], None]], repeats: int) -> dict[str, tuple[float, float]]:
    """Median (wall seconds, CPU seconds of all threads) per step."""
    for run in contenders.values():
        run()  # first step: torch and DeepSpeed allocate their states
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, run in contenders.items():
            wall, cpu = time.perf_counter(), time.process_time()
            run()
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    return {
        name: (statistics.median(w for w, _ in t), statistics.median(c for _, c in t))
        for name, t in times.items()
    }


def ceiling_gbs(binary: Path, threads: int, repeats: int) -> float | None:
    """GB/s of the Adam-pattern loop over 100M parameters (median), or None
    without the binary (or for a thread count it does not register)."""
    if not binary.exists():
        return None
    out = subprocess.run(
        [str(binary), f"--benchmark_filter=BM_AdamPatternCeiling/{CEILING_NUMEL}/{threads}/",
         f"--benchmark_repetitions={repeats}", "--benchmark_min_time=0.1",
         "--benchmark_format=json"],
        capture_output=True, text=True, check=False,
    )
    if out.returncode != 0 or not out.stdout.strip():
        return None
    runs = [b for b in json.loads(out.stdout)["benchmarks"] if b.get("run_type") == "iteration"]
    if not runs:
        return None
    seconds = statistics.median(b["real_time"] for b in runs) / 1e3  # reported in ms
    return BYTES_PER_PARAM * CEILING_NUMEL / seconds / 1e9


def table(title: str, n: int, medians: dict[str, tuple[float, float]], ceiling: float | None) -> list[str]:
    ours = medians["zcore"][0]
    rows = [
        f"\n{title}",
        "| contender | median ms | GB/s (28 B/param) | zcore speed-up | CPU ms, all threads |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, (seconds, cpu) in medians.items():
        gbs = BYTES_PER_PARAM * n / seconds / 1e9
        rows.append(f"| {name} | {seconds * 1e3:.1f} | {gbs:.1f} | {seconds / ours:.2f}x | {cpu * 1e3:.0f} |")
    if ceiling is not None:
        seconds = BYTES_PER_PARAM * n / (ceiling * 1e9)
        rows.append(f"| ceiling: Adam-pattern loop (C++, 100M) | {seconds * 1e3:.1f} | {ceiling:.1f} | - | - |")
    return rows


def adamw_foreach(ps: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=True)


def adamw_fused(ps: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    n = args.numel
    notes: list[str] = []
    deepspeed_cls = None if args.no_deepspeed else load_deepspeed(notes)

    def deepspeed(ps: list[torch.Tensor]) -> torch.optim.Optimizer:
        return deepspeed_cls(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True)

    grads = gradients(n)
    fp32 = {
        "zcore": zcore_step(n, grads, None),
        "torch AdamW foreach": optimizer_step(adamw_foreach, n, grads, None),
        "torch AdamW fused": optimizer_step(adamw_fused, n, grads, None),
    }
    if deepspeed_cls is not None:
        fp32["DeepSpeedCPUAdam"] = optimizer_step(deepspeed, n, grads, None)
    fp32_medians = time_round_robin(fp32, args.repeats)
    del fp32, grads
    gc.collect()

    grads16 = gradients(n).to(torch.bfloat16)
    outs = {name: torch.empty(n, dtype=torch.bfloat16) for name in ("zcore", "torch", "deepspeed")}
    mixed = {
        "zcore": zcore_step(n, grads16, outs["zcore"]),
        "torch: cast, AdamW fused, cast": optimizer_step(adamw_fused, n, torch.empty(n), (grads16, outs["torch"])),
    }
    if deepspeed_cls is not None:
        mixed["DeepSpeed: cast, DeepSpeedCPUAdam, cast"] = optimizer_step(
            deepspeed, n, torch.empty(n), (grads16, outs["deepspeed"]))
    mixed_medians = time_round_robin(mixed, args.repeats)
    del mixed
    gc.collect()

    ceiling = ceiling_gbs(args.ceiling_binary, args.threads, args.repeats)
    if ceiling is None:
        notes.append(f"no bandwidth ceiling: {args.ceiling_binary} (built by scripts/setup.sh) is missing "
                     f"or has no ceiling loop for {args.threads} threads")
    print(f"Fused CPU Adam, {n:,} params, {args.threads} threads, median of {args.repeats} "
          f"(zcore SIMD level: {zo.cpu_isa()}, torch {torch.__version__})")
    for line in table("fp32 step", n, fp32_medians, ceiling):
        print(line)
    for line in table("mixed-precision offload step (bf16 grads in, bf16 params out)", n, mixed_medians, ceiling):
        print(line)
    for note in notes:
        print(f"\nnote: {note}")


if __name__ == "__main__":
    main()
