"""Blockwise quantization on a CUDA device: zcore's kernels (the device side
of qwZ/qgZ: zcore.comm.quantization on CUDA tensors) against the same
operations written with torch ops (bench/quantize.py's peer), with the
device's copy bandwidth measured in the same run.

For int8 and int4, fp32 and bf16 tensors, and each size in --sizes-mib (MiB
of the full-precision tensor), three operations:
  quantize        tensor -> codes + one fp32 scale per --block elements;
  dequantize      codes + scales -> a tensor of the same dtype;
  dequantize_add  fp32 accumulator += decoded codes (one input).
"GB/s" is bytes of the full-precision tensor per second, as bench/quantize.py
counts, so the columns compare. "% of copy" counts the bytes each operation
moves (reads and writes: the tensor or the accumulator, the codes and the
scales) against a device-to-device copy (bench/gpu_adam.py's: 4 GiB, read +
write). Medians of
--repeats CUDA-event-timed runs after one warm-up. The torch peer skips
zcore's zero- and non-finite-block handling (the random data has neither),
which only flatters it.

    python bench/gpu_quantize.py [--sizes-mib 16 256] [--block 256] [--repeats 10]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

import zcore
from gpu_adam import copy_bandwidth, timed
from quantize import MIB, random_tensor, torch_decode, torch_quantize
from zcore.comm import quantization as zq


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[16, 256])
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=10)
    return parser.parse_args()


def moved_bytes(op: str, numel: int, element: int, bits: int, block: int) -> int:
    """Bytes an operation reads and writes: the coded side is numel * bits / 8
    bytes of codes and one fp32 scale per block."""
    coded = numel * bits // 8 + numel // block * 4
    if op == "quantize":
        return numel * element + coded
    if op == "dequantize":
        return coded + numel * element
    return coded + 2 * numel * 4  # the fp32 accumulator, read and written


def contenders(op: str, x: torch.Tensor, bits: int, block: int) -> dict[str, Callable[[], object]]:
    codes, scales = zq.quantize(x, bits, block)
    out = torch.empty_like(x)
    acc = torch.zeros(x.numel(), device=x.device)
    if op == "quantize":
        return {"zcore": lambda: zq.quantize(x, bits, block), "torch": lambda: torch_quantize(x, bits, block)}
    if op == "dequantize":
        return {
            "zcore": lambda: zq.dequantize(codes, scales, bits, block, x.numel(), x.dtype, out),
            "torch": lambda: out.view(-1, block).copy_(torch_decode(codes, scales, bits, block)),
        }
    return {
        "zcore": lambda: zq.dequantize_add(acc, [(codes, scales)], bits, block),
        "torch": lambda: acc.view(-1, block).add_(torch_decode(codes, scales, bits, block)),
    }


def main() -> None:
    args = parse_args()
    if not zcore.cuda_available():
        raise SystemExit(f"no usable GPU: {zcore.cuda_unavailable_reason()}")
    ceiling = copy_bandwidth(args.repeats)
    print(f"CUDA blockwise quantization on {torch.cuda.get_device_name()}; block {args.block}; "
          f"medians of {args.repeats}; device copy (read + write) {ceiling:.0f} GB/s")
    print("\n| op | bits | dtype | MiB | zcore GB/s | torch GB/s | zcore speed-up | zcore % of copy |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for mib in args.sizes_mib:
        for dtype in (torch.float32, torch.bfloat16):
            x = random_tensor(mib, dtype, args.block, device="cuda")
            numel, element = x.numel(), x.element_size()
            for bits in (8, 4):
                for op in ("quantize", "dequantize", "dequantize_add"):
                    runs = contenders(op, x, bits, args.block)
                    seconds = {name: timed(run, args.repeats) for name, run in runs.items()}
                    gbs = {name: numel * element / s / 1e9 for name, s in seconds.items()}
                    share = moved_bytes(op, numel, element, bits, args.block) / seconds["zcore"] / 1e9 / ceiling
                    print(
                        f"| {op} | {bits} | {str(dtype).removeprefix('torch.')} | {numel * element / MIB:g} | "
                        f"{gbs['zcore']:.0f} | {gbs['torch']:.0f} | {seconds['torch'] / seconds['zcore']:.2f}x | "
                        f"{100 * share:.0f}% |"
                    )
                    del runs
            del x
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
