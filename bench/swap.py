"""What the swap manager's integrity checks cost: zcore.SwapManager against
its own AioEngine moving the same bytes, and fio, in one run.

    python bench/swap.py [--dir build/bench-swap] [--tensors 16] [--tensor-size 64M] [--repeats 5]

The swap manager adds, to the engine's I/O, a file-identity check (stat of
the swap file before each submit and after each completion) and an XXH3
checksum of every tensor (computed on swap-out before the write is submitted,
verified on swap-in after the read completes), plus its extent bookkeeping.
Each repetition swaps `--tensors` tensors of `--tensor-size` out (all in
flight, then waited for) and back in, and the engine alone writes and reads
the same tensors at the same offsets of a file with the same settings; fio
writes and reads the same total with libaio and O_DIRECT at the same block
size and queue depth. Tools alternate, their order rotated each repetition,
so the disk's drift hits all alike. Prints medians and [min, max] in GB/s
(1e9 bytes/s) and the swap manager's share of the engine's rate. Scratch
files live under --dir and are deleted.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

import zcore
from zcore.memory.aio_tune import aligned_buffer, parse_size

BLOCK_SIZE = 1 << 20
QUEUE_DEPTH = 32


def engine_tool(directory: Path, tensors: list[torch.Tensor]) -> Callable[[bool], float]:
    engine = zcore.AioEngine(directory, block_size=BLOCK_SIZE, queue_depth=QUEUE_DEPTH, backend="libaio")
    path = directory / "engine.bin"
    size = tensors[0].numel()

    def run(write: bool) -> float:
        start = time.perf_counter()
        op = engine.pwrite if write else engine.pread
        handles = [op(t, path, i * size) for i, t in enumerate(tensors)]
        for handle in handles:
            handle.wait()
        return len(tensors) * size / (time.perf_counter() - start) / 1e9

    return run


def swap_tool(directory: Path, tensors: list[torch.Tensor]) -> Callable[[bool], float]:
    size = tensors[0].numel()
    swap = zcore.SwapManager(
        directory, len(tensors) * size, rank=0, block_size=BLOCK_SIZE, queue_depth=QUEUE_DEPTH, backend="libaio"
    )

    def run(write: bool) -> float:
        start = time.perf_counter()
        for key, t in enumerate(tensors):
            if write:
                swap.swap_out(key, t)
            else:
                swap.swap_in(key, t)
        swap.wait_all()
        return len(tensors) * size / (time.perf_counter() - start) / 1e9

    return run


def fio_tool(directory: Path, total: int) -> Callable[[bool], float]:
    if shutil.which("fio") is None:
        raise FileNotFoundError("fio is not installed (apt-get install fio)")
    path = directory / "fio.bin"

    def run(write: bool) -> float:
        command = [
            "fio", "--name=bench", f"--filename={path}", f"--rw={'write' if write else 'read'}",
            f"--bs={BLOCK_SIZE}", f"--iodepth={QUEUE_DEPTH}", "--ioengine=libaio", "--direct=1",
            f"--size={total}", "--thread", "--fallocate=none", "--output-format=json",
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        return json.loads(done.stdout)["jobs"][0]["write" if write else "read"]["bw_bytes"] / 1e9

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=Path("build/bench-swap"))
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--tensor-size", type=parse_size, default=64 << 20)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    args.dir.mkdir(parents=True, exist_ok=True)
    scratch = args.dir / f"run-{time.time_ns()}"
    scratch.mkdir()
    try:
        tensors = [aligned_buffer(args.tensor_size) for _ in range(args.tensors)]
        tools: dict[str, Callable[[bool], float]] = {
            "engine": engine_tool(scratch, tensors),
            "swap manager": swap_tool(scratch, tensors),
        }
        try:
            tools["fio"] = fio_tool(scratch, args.tensors * args.tensor_size)
        except FileNotFoundError as missing:
            print(f"fio row left out: {missing}")
        for run in tools.values():  # allocate every file once; timed writes overwrite
            run(True)
        rates: dict[tuple[str, bool], list[float]] = {(name, w): [] for name in tools for w in (True, False)}
        names = list(tools)
        for repeat in range(args.repeats):
            order = names[repeat % len(names) :] + names[: repeat % len(names)]
            for write in (True, False):
                for name in order:
                    rates[(name, write)].append(tools[name](write))
        report(rates, names, args)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def report(rates: dict[tuple[str, bool], list[float]], names: list[str], args: argparse.Namespace) -> None:
    total = args.tensors * args.tensor_size
    print(
        f"\n{args.tensors} tensors x {args.tensor_size >> 20} MiB = {total / 2**30:.2f} GiB, "
        f"block {BLOCK_SIZE >> 10} KiB, queue depth {QUEUE_DEPTH}, {args.repeats} repeats, GB/s median [min, max]\n"
    )
    print("| op | " + " | ".join(names) + " | swap manager / engine |")
    print("| --- |" + " --- |" * (len(names) + 1))
    for write in (True, False):
        cells = []
        for name in names:
            r = rates[(name, write)]
            cells.append(f"{statistics.median(r):.2f} [{min(r):.2f}, {max(r):.2f}]")
        ratio = statistics.median(rates[("swap manager", write)]) / statistics.median(rates[("engine", write)])
        print(f"| {'write' if write else 'read'} | " + " | ".join(cells) + f" | {ratio:.3f} |")


if __name__ == "__main__":
    main()
