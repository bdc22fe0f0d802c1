"""Blockwise quantization on the CPU: zcore.comm.quantization against the same
operations written with torch ops (the peer).

For int8 and int4, fp32 and bf16 tensors, 1 and 2 threads, and each size in
--sizes-mib (MiB of the full-precision tensor), three operations are timed:
  quantize        tensor -> codes + one fp32 scale per --block elements;
  dequantize      codes + scales -> a tensor of the same dtype;
  dequantize_add  fp32 accumulator += decoded codes (one input).
GB/s is bytes of the full-precision tensor (numel * its element size) per
second, for every operation, so the columns compare. Contenders run
round-robin, --repeats times each (medians), so that a noisy machine slows
them alike. The torch peer skips zcore's zero- and non-finite-block handling
(the random data has neither), which only flatters it.

    .venv/bin/python bench/quantize.py [--sizes-mib 1 16 256] [--block 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import zcore.optim as zo
from zcore.comm import quantization as zq

MIB = 1 << 20


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 16, 256])
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=5)
    return parser.parse_args()


# ------------------------------------------------------------ the torch peer --


def torch_quantize(x: torch.Tensor, bits: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    qmax = 127.0 if bits == 8 else 7.0
    rows = x.float().view(-1, block)
    scales = rows.abs().amax(dim=1) / qmax
    q = torch.round(rows / scales[:, None]).clamp_(-qmax, qmax).to(torch.int8)
    if bits == 8:
        return q.flatten(), scales
    return ((q[:, 0::2] & 0xF) | (q[:, 1::2] << 4)).view(torch.uint8).flatten(), scales


def torch_decode(codes: torch.Tensor, scales: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    if bits == 8:
        q = codes.view(-1, block)
    else:
        packed = codes.view(torch.int8).view(-1, block // 2)
        # Shift each nibble to the top of the byte, then back: sign extension.
        q = torch.stack([(packed << 4) >> 4, packed >> 4], dim=2).view(-1, block)
    return q.float() * scales[:, None]


# --------------------------------------------------------------- contenders --


def contenders(op: str, x: torch.Tensor, bits: int, block: int, threads: int) -> dict[str, Callable[[], object]]:
    codes, scales = zq.quantize(x, bits, block, num_threads=threads)
    out = torch.empty_like(x)
    acc = torch.zeros(x.numel())
    if op == "quantize":
        return {
            "zcore": lambda: zq.quantize(x, bits, block, num_threads=threads),
            "torch": lambda: torch_quantize(x, bits, block),
        }
    if op == "dequantize":
        return {
            "zcore": lambda: zq.dequantize(codes, scales, bits, block, x.numel(), x.dtype, out, num_threads=threads),
            "torch": lambda: out.view(-1, block).copy_(torch_decode(codes, scales, bits, block)),
        }
    return {
        "zcore": lambda: zq.dequantize_add(acc, [(codes, scales)], bits, block, num_threads=threads),
        "torch": lambda: acc.view(-1, block).add_(torch_decode(codes, scales, bits, block)),
    }


def median_seconds(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    for run in runs.values():
        run()  # warm-up: first-touch of the outputs
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def random_tensor(mib: float, dtype: torch.dtype, block: int, device: str = "cpu") -> torch.Tensor:
    """About ``mib`` MiB of normal values in ``dtype``, a whole number of blocks."""
    element = torch.empty(0, dtype=dtype).element_size()
    numel = max(block, int(mib * MIB) // element // block * block)
    return torch.randn(numel, device=device).to(dtype)


def main() -> None:
    args = parse_args()
    print(f"CPU ISA level: {zo.cpu_isa()}; block {args.block}; medians of {args.repeats}")
    print("\n| op | bits | dtype | threads | MiB | zcore GB/s | torch GB/s | zcore speed-up |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for mib in args.sizes_mib:
        for dtype in (torch.float32, torch.bfloat16):
            x = random_tensor(mib, dtype, args.block)
            numel, element = x.numel(), x.element_size()
            for threads in args.threads:
                torch.set_num_threads(threads)
                for bits in (8, 4):
                    for op in ("quantize", "dequantize", "dequantize_add"):
                        seconds = median_seconds(contenders(op, x, bits, args.block, threads), args.repeats)
                        gbs = {name: numel * element / s / 1e9 for name, s in seconds.items()}
                        print(
                            f"| {op} | {bits} | {str(dtype).removeprefix('torch.')} | {threads} | "
                            f"{numel * element / MIB:g} | {gbs['zcore']:.2f} | {gbs['torch']:.2f} | "
                            f"{seconds['torch'] / seconds['zcore']:.2f}x |"
                        )


if __name__ == "__main__":
    main()
