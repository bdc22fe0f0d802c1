"""Finds the I/O engine settings that move bytes fastest in a directory.

    python -m zcore.memory.aio_tune /mnt/nvme/swap [--size 256M] [--repeats 2]

Sweeps block size, queue depth and worker threads, writing and reading a
scratch file with O_DIRECT (the file is deleted afterwards), and prints the
throughput of each setting and the best ones for reads, for writes and for
both (the largest harmonic mean of the two), ready to paste into
``zcore.AioEngine(...)`` or ``zcore.SwapManager(...)``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from zcore.memory.aio import AioEngine
from zcore.memory.host_memory import HostMemory

BLOCK_SIZES = (256 << 10, 1 << 20, 4 << 20)
QUEUE_DEPTHS = (8, 32, 128)
THREADS = (1, 2, 4)


@dataclass(frozen=True)
class Setting:
    block_size: int
    queue_depth: int
    threads: int

    def __str__(self) -> str:
        return f"block_size={self.block_size}, queue_depth={self.queue_depth}, threads={self.threads}"


@dataclass(frozen=True)
class Result:
    setting: Setting
    write_gbps: float
    read_gbps: float

    @property
    def both_gbps(self) -> float:
        return statistics.harmonic_mean([self.write_gbps, self.read_gbps])


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def aligned_buffer(size: int) -> torch.Tensor:
    """A page-aligned, locked-if-permitted host buffer filled with random bytes."""
    buffer = HostMemory(size, lock="try").zeros((size,), torch.uint8)
    buffer.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
    return buffer


def timed_gbps(engine: AioEngine, buffer: torch.Tensor, path: Path, write: bool) -> float:
    """GB/s (1e9 bytes) of one write or read of the whole buffer, open included."""
    start = time.perf_counter()
    handle = engine.pwrite(buffer, path) if write else engine.pread(buffer, path)
    handle.wait()
    return buffer.numel() / (time.perf_counter() - start) / 1e9


def measure(setting: Setting, buffer: torch.Tensor, path: Path, repeats: int) -> Result:
    engine = AioEngine(
        path.parent,
        block_size=setting.block_size,
        queue_depth=setting.queue_depth,
        threads=setting.threads,
        backend="auto",
    )
    writes, reads = [], []
    for _ in range(repeats):
        writes.append(timed_gbps(engine, buffer, path, write=True))
        reads.append(timed_gbps(engine, buffer, path, write=False))
    return Result(setting, statistics.median(writes), statistics.median(reads))


def sweep(
    directory: Path,
    size: int,
    repeats: int,
    block_sizes: Sequence[int] = BLOCK_SIZES,
    queue_depths: Sequence[int] = QUEUE_DEPTHS,
    threads: Sequence[int] = THREADS,
) -> list[Result]:
    buffer = aligned_buffer(size)
    path = directory / f".zcore-aio-tune-{os.getpid()}.bin"
    try:
        # Written once first, so every timed write overwrites allocated blocks.
        timed_gbps(AioEngine(directory), buffer, path, write=True)
        return [
            measure(Setting(b, q, t), buffer, path, repeats)
            for b, q, t in itertools.product(block_sizes, queue_depths, threads)
        ]
    finally:
        path.unlink(missing_ok=True)


def report(results: list[Result], backend: str) -> str:
    lines = [
        f"engine backend: {backend}",
        f"{'block_size':>10} {'queue_depth':>11} {'threads':>7} {'write GB/s':>10} {'read GB/s':>9}",
    ]
    for r in results:
        s = r.setting
        lines.append(
            f"{s.block_size:>10} {s.queue_depth:>11} {s.threads:>7} "
            f"{r.write_gbps:>10.2f} {r.read_gbps:>9.2f}"
        )
    best_write = max(results, key=lambda r: r.write_gbps)
    best_read = max(results, key=lambda r: r.read_gbps)
    best_both = max(results, key=lambda r: r.both_gbps)
    lines += [
        f"best for writes: {best_write.setting} ({best_write.write_gbps:.2f} GB/s)",
        f"best for reads:  {best_read.setting} ({best_read.read_gbps:.2f} GB/s)",
        f"best for both:   {best_both.setting} "
        f"(write {best_both.write_gbps:.2f}, read {best_both.read_gbps:.2f} GB/s)",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, help="where the swap files will live")
    parser.add_argument("--size", default="256M", help="bytes per transfer (default 256M)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per setting (median)")
    args = parser.parse_args(argv)
    results = sweep(args.directory, parse_size(args.size), args.repeats)
    print(report(results, AioEngine(args.directory).backend))


if __name__ == "__main__":
    main()
