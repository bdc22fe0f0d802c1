"""NVMe I/O engines on this machine's disk: zcore vs fio vs DeepSpeed's aio_handle.

    python bench/aio.py [--dir build/bench-aio] [--sizes 1G,4G] [--repeats 5]

All use libaio with O_DIRECT on page-aligned, locked host buffers: zcore on
its own host memory (2 MiB transparent huge pages), zcore-4k on 4 KiB pages
like DeepSpeed's locked tensors (the engine alone), fio on its own. Each is
first swept over block size, queue depth and threads (DeepSpeed also over
overlap_events) on --sweep-size transfers; then each, at its best setting for
the operation, writes and reads every size --repeats times, tools interleaved
and their order rotated so that drift of the (virtual, noisy) disk hits all
alike; the same loop also runs every tool at one common setting. Prints
medians and [min, max] in GB/s (1e9 bytes/s), and the ratios of zcore's
median to the others'. Scratch files live under --dir and are deleted.

DeepSpeed is optional (`pip install deepspeed==0.19.8`; it JIT-builds its aio
op with libaio-dev on first use); without it its rows say why.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

import zcore
from zcore.memory.aio_tune import aligned_buffer, parse_size

GRID_BLOCK = (256 << 10, 1 << 20, 4 << 20)
GRID_DEPTH = (16, 64)
GRID_THREADS = (1, 2)


@dataclass(frozen=True)
class Setting:
    block_size: int
    queue_depth: int
    threads: int
    overlap_events: bool = False  # DeepSpeed only

    def label(self) -> str:
        text = f"bs={self.block_size >> 10}K qd={self.queue_depth} t={self.threads}"
        return text + (" overlap" if self.overlap_events else "")


class Tool:
    """One I/O engine: writes or reads `size` bytes of its file, returns GB/s."""

    name = ""

    def grid(self) -> list[Setting]:
        return [Setting(b, q, t) for b, q, t in itertools.product(GRID_BLOCK, GRID_DEPTH, GRID_THREADS)]

    def prepare(self, size: int) -> None:
        """Allocates buffers and writes the file once, so timed writes overwrite."""

    def run(self, setting: Setting, write: bool, size: int) -> float:
        raise NotImplementedError

    def release(self) -> None:
        """Frees the buffers of the last prepare()."""


class Zcore(Tool):
    name = "zcore"

    def __init__(self, directory: Path) -> None:
        self.path = directory / "zcore.bin"
        self.engines: dict[Setting, zcore.AioEngine] = {}
        self.buffer: torch.Tensor | None = None

    def prepare(self, size: int) -> None:
        self.buffer = aligned_buffer(size)
        self.run(Setting(1 << 20, 32, 1), True, size)

    def run(self, setting: Setting, write: bool, size: int) -> float:
        engine = self.engines.get(setting)
        if engine is None:
            engine = zcore.AioEngine(
                self.path.parent,
                block_size=setting.block_size,
                queue_depth=setting.queue_depth,
                threads=setting.threads,
                backend="libaio",
            )
            self.engines[setting] = engine
        buffer = self.buffer[:size]
        start = time.perf_counter()
        (engine.pwrite if write else engine.pread)(buffer, self.path).wait()
        return size / (time.perf_counter() - start) / 1e9

    def release(self) -> None:
        self.buffer = None


class ZcoreSmallPages(Zcore):
    """zcore's engine on a buffer of 4 KiB pages (page-aligned, locked), like
    DeepSpeed's: separates the engine's share of zcore's speed from that of
    its huge-page host buffers."""

    name = "zcore-4k"

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.path = directory / "zcore-4k.bin"
        self.mapping: mmap.mmap | None = None

    def prepare(self, size: int) -> None:
        self.mapping = mmap.mmap(-1, size)
        self.mapping.madvise(mmap.MADV_NOHUGEPAGE)
        self.buffer = torch.frombuffer(self.mapping, dtype=torch.uint8)
        self.buffer.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
        ctypes.CDLL(None).mlock(ctypes.c_void_p(self.buffer.data_ptr()), ctypes.c_size_t(size))
        self.run(Setting(1 << 20, 32, 1), True, size)

    def release(self) -> None:
        self.buffer = None  # the mapping is unmapped (and unlocked) when collected
        self.mapping = None


class Fio(Tool):
    name = "fio"

    def __init__(self, directory: Path) -> None:
        if shutil.which("fio") is None:
            raise FileNotFoundError("fio is not installed (apt-get install fio)")
        self.path = directory / "fio.bin"

    def prepare(self, size: int) -> None:
        self.run(Setting(1 << 20, 32, 1), True, size)

    def run(self, setting: Setting, write: bool, size: int) -> float:
        share = size // setting.threads
        command = [
            "fio", "--name=bench", f"--filename={self.path}", f"--rw={'write' if write else 'read'}",
            f"--bs={setting.block_size}", f"--iodepth={setting.queue_depth}", "--ioengine=libaio",
            "--direct=1", f"--size={share}", f"--numjobs={setting.threads}",
            f"--offset_increment={share}", "--thread", "--group_reporting",
            "--fallocate=none", "--output-format=json",
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        job = json.loads(done.stdout)["jobs"][0]["write" if write else "read"]
        return job["bw_bytes"] / 1e9


class DeepSpeed(Tool):
    name = "deepspeed"

    def __init__(self, directory: Path) -> None:
        self.path = directory / "deepspeed.bin"
        self.handles: dict[Setting, object] = {}
        self.buffer: torch.Tensor | None = None
        # A private JIT build directory: ~/.cache/torch_extensions is shared
        # by every checkout and venv of the user, which rebuild over each other.
        repo = Path(__file__).resolve().parents[1]
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(repo / "build" / "torch_extensions"))
        from deepspeed.ops.op_builder import AsyncIOBuilder  # noqa: PLC0415 - optional peer

        self.module = AsyncIOBuilder().load(verbose=False)

    def grid(self) -> list[Setting]:
        return [
            Setting(s.block_size, s.queue_depth, s.threads, overlap)
            for s in super().grid()
            for overlap in (False, True)
        ]

    def handle(self, s: Setting) -> object:
        if s not in self.handles:
            self.handles[s] = self.module.aio_handle(
                s.block_size, s.queue_depth, False, s.overlap_events, s.threads
            )
        return self.handles[s]

    def prepare(self, size: int) -> None:
        setting = Setting(1 << 20, 32, 1)
        # The handle's own page-locked memory: DeepSpeed copies any other
        # CPU tensor through a bounce buffer first.
        self.buffer = self.handle(setting).new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
        self.buffer.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
        self.run(setting, True, size)

    def run(self, setting: Setting, write: bool, size: int) -> float:
        handle = self.handle(setting)
        buffer = self.buffer[:size]
        start = time.perf_counter()
        count = (handle.sync_pwrite if write else handle.sync_pread)(buffer, str(self.path))
        elapsed = time.perf_counter() - start
        if count < 0:
            raise RuntimeError(f"deepspeed {'write' if write else 'read'} failed ({count})")
        return size / elapsed / 1e9

    def release(self) -> None:
        if self.buffer is not None:
            next(iter(self.handles.values())).free_cpu_locked_tensor(self.buffer)
        self.buffer = None


# Same block size, queue depth and threads for every tool: the comparison
# that does not depend on how each sweep's noise picked its "best".
COMMON = Setting(1 << 20, 64, 1)
KINDS = ("best", "same")
Key = tuple[str, str, str, int]  # tool, kind, op, size


def best_settings(tool: Tool, size: int, repeats: int) -> dict[str, tuple[Setting, float]]:
    """The fastest setting for writes and for reads (median of `repeats`)."""
    best: dict[str, tuple[Setting, float]] = {}
    for setting in tool.grid():
        for op, write in (("write", True), ("read", False)):
            gbps = statistics.median(tool.run(setting, write, size) for _ in range(repeats))
            if op not in best or gbps > best[op][1]:
                best[op] = (setting, gbps)
    return best


def common_setting(tool: Tool) -> Setting:
    # DeepSpeed keeps its queue full only with overlap_events.
    return Setting(COMMON.block_size, COMMON.queue_depth, COMMON.threads, tool.name == "deepspeed")


def rotations(tools: list[Tool], repeats: int) -> Iterator[list[Tool]]:
    for r in range(repeats):
        k = r % len(tools)
        yield tools[k:] + tools[:k]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("build/bench-aio"))
    parser.add_argument("--sizes", default="1G,4G")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sweep-size", default="512M")
    parser.add_argument("--sweep-repeats", type=int, default=2)
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    sweep_size = parse_size(args.sweep_size)
    args.dir.mkdir(parents=True, exist_ok=True)

    makers: list[Callable[[Path], Tool]] = [Zcore, ZcoreSmallPages, Fio, DeepSpeed]
    tools: list[Tool] = []
    for make in makers:
        try:
            tools.append(make(args.dir))
        except Exception as exc:  # noqa: BLE001 - a missing peer is reported, not fatal
            print(f"{make.__name__}: unavailable ({type(exc).__name__}: {exc})")
    try:
        settings: dict[tuple[str, str, str], Setting] = {}  # (tool, kind, op)
        for tool in tools:
            tool.prepare(sweep_size)
            for op, (setting, gbps) in best_settings(tool, sweep_size, args.sweep_repeats).items():
                print(f"sweep {tool.name:>9} {op:>5}: best {setting.label()} ({gbps:.2f} GB/s)")
                settings[(tool.name, "best", op)] = setting
                settings[(tool.name, "same", op)] = common_setting(tool)
            tool.release()

        samples: dict[Key, list[float]] = {}
        for size in sizes:
            for tool in tools:
                tool.prepare(size)
            for order in rotations(tools, args.repeats):
                for tool, kind in itertools.product(order, KINDS):
                    for op, write in (("write", True), ("read", False)):
                        gbps = tool.run(settings[(tool.name, kind, op)], write, size)
                        samples.setdefault((tool.name, kind, op, size), []).append(gbps)
            for tool in tools:
                tool.release()
        print_table([t.name for t in tools], settings, samples, sizes, args.repeats)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)


def size_label(size: int) -> str:
    return f"{size >> 30}G" if size >= 1 << 30 else f"{size >> 20}M"


def print_table(
    tools: list[str],
    settings: dict[tuple[str, str, str], Setting],
    samples: dict[Key, list[float]],
    sizes: list[int],
    repeats: int,
) -> None:
    print(f"\nGB/s (1e9 B/s): median [min, max] of {repeats} interleaved runs")
    print("best = each tool's best sweep setting; same = " + COMMON.label() + " for all")
    print(f"{'size':>5} {'op':>5} {'kind':>4} {'tool':>9} {'median':>7} {'range':>14}  setting")
    for size, op, kind in itertools.product(sizes, ("write", "read"), KINDS):
        medians = {}
        for tool in tools:
            values = samples[(tool, kind, op, size)]
            medians[tool] = statistics.median(values)
            print(
                f"{size_label(size):>5} {op:>5} {kind:>4} {tool:>9} {medians[tool]:>7.2f} "
                f"[{min(values):5.2f}, {max(values):5.2f}]  {settings[(tool, kind, op)].label()}"
            )
        if "zcore" in medians:
            ratios = ", ".join(
                f"zcore/{t} {medians['zcore'] / medians[t]:.2f}x" for t in tools if t != "zcore"
            )
            print(f"{'':>16} {ratios}")


if __name__ == "__main__":
    sys.exit(main())
