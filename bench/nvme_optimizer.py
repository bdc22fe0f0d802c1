"""Optimizer states on NVMe (ZeRO-Infinity): the optimizer step against the
disk's bound, measured with fio on the same directory in the same run
(issue 14, benchmark 3: at least 0.8x of the bound).

    .venv/bin/python bench/nvme_optimizer.py [--nvme-path build/bench-nvme-optimizer]
        [--params 300M] [--dtype bf16] [--stage 1] [--sub-group-size N]
        [--warmup 2] [--steps 3] [--rounds 3]

A stack of plain nn.Linear layers (no bias, --width wide) with --params
parameters trains at world 1 with only ``offload_optimizer`` on NVMe, so a
step is optimizer work: every sub-group of fp32 master, exp_avg and
exp_avg_sq (12 bytes per element) is read from the swap file, stepped by
zcore's fused CPU Adam (bf16 parameters written in the same pass with
--dtype bf16) and written back, the next read and the previous write
overlapping this one's step. Forward and backward (one row of input) are
outside the timed region: only ``engine.step()`` at an accumulation
boundary is timed, which is the optimizer step plus what surrounds it
(zeroing the gradients; no clipping, no loss scale in bf16/fp32). The
"update stream" column is the part of it spent streaming the sub-groups.
Stage 1 by default: at stages 2-3 gradient shards may pass through NVMe
too, which is not optimizer-state traffic; a cross-check line compares the
process's own I/O during the steps (/proc/self/io) with the swap file's
counters and says when other I/O is in the step.

Each of --rounds rounds times --steps steps (after --warmup untimed steps
at the start), taking the bytes read and written from the swap manager's
counters, then runs fio on files in the same directory with the same access
pattern: one file read sequentially, then overwritten sequentially (the
optimizer's swap file holds the sub-groups' extents end to end and a step
reads and writes them in order), as many bytes as one step reads and writes,
libaio, O_DIRECT, the config's aio block size and queue depth, one job;
then the same reads and writes at once (two jobs), as the step's pipeline
overlaps them. fio lays out its files once, untimed, so that its timed
writes overwrite, as the step's do.

Bounds per step (seconds), from the same round's fio figures:
- serial: read bytes / fio read bandwidth + written bytes / fio write
  bandwidth. "Bytes moved divided by fio's bandwidth": the issue's target
  (bound / step time >= 0.8) uses this one.
- overlapped: max(read time, write time), a floor only if the disk could
  read and write at full speed at once.
- fio at once: how long fio took to read and write the same bytes at once.

The page cache is dropped (as root) before each phase; zcore's swap I/O
and fio both use O_DIRECT, so this only matters where the directory's
filesystem refuses O_DIRECT (then zcore reports the "threadpool" backend
and the figures measure the page cache, not the disk). /tmp may be tmpfs:
give --nvme-path on the disk to measure. The last line times
zcore.optim.adam_step_flat alone on in-memory buffers of one sub-group
(after the engine is gone), scaled to all elements, to say whether the
step is bound by the disk or by compute. GB = 1e9 bytes. Scratch files live under --nvme-path and are
removed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

import zcore
import zcore.optim as zo
from zcore.memory.aio_tune import parse_size

ROOT = Path(__file__).resolve().parent.parent
STATE_BYTES = 12  # fp32 master, exp_avg, exp_avg_sq per element
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
ADAM = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nvme-path", type=Path, default=ROOT / "build/bench-nvme-optimizer",
                        help="directory on the disk to measure (not tmpfs)")
    parser.add_argument("--params", type=parse_count, default=300_000_000,
                        help="parameters, e.g. 300M or 2.5e8 (default 300M)")
    parser.add_argument("--width", type=int, default=2048, help="in and out features of each Linear")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="compute dtype (default bf16)")
    parser.add_argument("--stage", type=int, choices=(1, 2, 3), default=1,
                        help="ZeRO stage (default 1: the step moves optimizer states only)")
    parser.add_argument("--sub-group-size", type=int, default=None,
                        help="zero_optimization.sub_group_size (default: zcore's, from host memory)")
    parser.add_argument("--block-size", type=parse_size, default=1 << 20, help="aio.block_size (default 1 MiB)")
    parser.add_argument("--queue-depth", type=int, default=8, help="aio.queue_depth (default 8)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before the first round")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of timed steps, then fio")
    parser.add_argument("--adam-repeats", type=int, default=5)
    parser.add_argument("--no-drop-caches", action="store_true", help="leave the page cache alone")
    return parser.parse_args()


def parse_count(text: str) -> int:
    """'300M', '1.5G', '2e6' or a plain number (K, M, G: powers of 1000)."""
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:].upper(), 1)
    try:
        return int(float(text[:-1] if scale > 1 else text) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count such as 300M or 2e6") from None


# --- the model and the engine -------------------------------------------------------------------


def linear_stack(params: int, width: int) -> nn.Sequential:
    """About ``params`` parameters as Linear(width, width) layers (width
    shrunk for small counts), scaled to keep activations near unit size
    (no denormals in the step's arithmetic)."""
    width = max(64, min(width, math.isqrt(params) // 64 * 64))
    layers = max(1, round(params / width**2))
    model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))
    with torch.no_grad():
        for layer in model:
            layer.weight.normal_(std=width**-0.5)
    return model


def engine_config(args: argparse.Namespace, nvme_path: Path) -> dict:
    zero: dict[str, Any] = {
        "stage": args.stage,
        "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme_path)},
    }
    if args.sub_group_size is not None:
        zero["sub_group_size"] = args.sub_group_size
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": ADAM},
        "bf16": {"enabled": args.dtype == "bf16"},
        "zero_optimization": zero,
        "aio": {"block_size": args.block_size, "queue_depth": args.queue_depth},
        "steps_per_print": 10**9,
    }


class TimedUpdate:
    """The engine's optimizer update, with the seconds its ``apply`` (the
    stream over the sub-groups) took; everything else passes through."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.seconds = 0.0

    def apply(self, coefficient: float) -> None:
        start = time.perf_counter()
        self.inner.apply(coefficient)
        self.seconds += time.perf_counter() - start

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@dataclass(frozen=True)
class StepFigures:
    step_s: float  # mean engine.step() seconds
    update_s: float  # of which streaming the sub-groups
    read_bytes: float  # per step, by the optimizer's swap file
    written_bytes: float
    process_read: float  # per step, by the whole process (/proc/self/io): a cross-check
    process_written: float


def train_micro_step(engine: Any, width: int, dtype: torch.dtype) -> None:
    x = torch.randn(1, width, dtype=dtype)
    engine.backward(engine(x).float().pow(2).mean())


def time_steps(engine: Any, timer: TimedUpdate, width: int, dtype: torch.dtype, steps: int) -> StepFigures:
    swap = engine.optimizer.master.swap
    before, stream_before = swap.stats(), timer.seconds
    total, process = 0.0, [0, 0]
    for _ in range(steps):
        train_micro_step(engine, width, dtype)
        io_before = process_io()
        start = time.perf_counter()
        engine.step()
        total += time.perf_counter() - start
        process = [p + after - b for p, after, b in zip(process, process_io(), io_before)]
    after = swap.stats()
    return StepFigures(
        step_s=total / steps,
        update_s=(timer.seconds - stream_before) / steps,
        read_bytes=(after.bytes_swapped_in - before.bytes_swapped_in) / steps,
        written_bytes=(after.bytes_swapped_out - before.bytes_swapped_out) / steps,
        process_read=process[0] / steps,
        process_written=process[1] / steps,
    )


def process_io() -> tuple[int, int]:
    """Bytes this process has read from and written to storage (O_DIRECT
    and libaio included), from /proc/self/io."""
    with open("/proc/self/io", encoding="ascii") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


# --- fio and the page cache ---------------------------------------------------------------------


@dataclass(frozen=True)
class FioFigures:
    read_bps: float  # read alone
    write_bps: float  # write alone
    both_read_bps: float  # read and write at once
    both_write_bps: float
    both_s: float  # how long the reads and writes at once took


class Fio:
    """fio on two files under ``directory``: A is read and overwritten, B
    written while A is read."""

    def __init__(self, directory: Path, read_bytes: int, write_bytes: int, block: int, depth: int) -> None:
        self.a, self.b = directory / "fio-a.bin", directory / "fio-b.bin"
        self.read_bytes = _round_up(read_bytes, block)
        self.write_bytes = _round_up(write_bytes, block)
        self.common = ["--ioengine=libaio", "--direct=1", f"--bs={block}", f"--iodepth={depth}",
                       "--thread", "--fallocate=none", "--output-format=json"]  # fmt: skip
        size = max(self.read_bytes, self.write_bytes)
        self._run([self._job("layout-a", self.a, "write", size), self._job("layout-b", self.b, "write", size)])

    def measure(self, drop: Callable[[], None]) -> FioFigures:
        drop()
        read = self._run([self._job("read", self.a, "read", self.read_bytes)])[0]["read"]
        drop()
        write = self._run([self._job("write", self.a, "write", self.write_bytes)])[0]["write"]
        drop()
        jobs = self._run([self._job("read", self.a, "read", self.read_bytes),
                          self._job("write", self.b, "write", self.write_bytes)])  # fmt: skip
        both_read, both_write = jobs[0]["read"], jobs[1]["write"]
        return FioFigures(
            read_bps=read["bw_bytes"], write_bps=write["bw_bytes"],
            both_read_bps=both_read["bw_bytes"], both_write_bps=both_write["bw_bytes"],
            both_s=max(both_read["runtime"], both_write["runtime"]) / 1e3,
        )  # fmt: skip

    @staticmethod
    def _job(name: str, path: Path, rw: str, size: int) -> list[str]:
        return [f"--name={name}", f"--filename={path}", f"--rw={rw}", f"--size={size}"]

    def _run(self, jobs: list[list[str]]) -> list[dict]:
        command = ["fio", *self.common, *(arg for job in jobs for arg in job)]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"fio failed ({done.returncode}): {' '.join(command)}\n{done.stderr[-2000:]}")
        return json.loads(done.stdout)["jobs"]


def _round_up(n: float, multiple: int) -> int:
    return max(multiple, -(-int(n) // multiple) * multiple)


def page_cache_dropper(enabled: bool) -> tuple[Callable[[], None], str]:
    """A callable that drops the page cache, and a line saying what it does."""
    if not enabled:
        return (lambda: None), "page cache: left alone (--no-drop-caches)"
    if os.geteuid() != 0:
        return (lambda: None), "page cache: not dropped (not root)"

    def drop() -> None:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w", encoding="ascii") as f:
            f.write("3\n")

    try:
        drop()
    except OSError as exc:
        return (lambda: None), f"page cache: not dropped ({exc})"
    return drop, "page cache: dropped before each phase"


def filesystem_of(path: Path) -> str:
    """The type of the filesystem ``path`` is on (the longest mount point
    that contains it, from /proc/mounts)."""
    best, kind = "", "unknown"
    resolved = str(path.resolve())
    with open("/proc/mounts", encoding="utf-8") as mounts:
        for line in mounts:
            fields = line.split()
            point = fields[1]
            inside = resolved == point or resolved.startswith(point.rstrip("/") + "/")
            if inside and len(point) > len(best):
                best, kind = point, fields[2]
    return kind


# --- CPU Adam alone -----------------------------------------------------------------------------


def adam_seconds(numel: int, total: int, dtype: torch.dtype, threads: Optional[int], repeats: int) -> float:
    """Seconds zcore's fused CPU Adam takes for ``total`` elements, timed on
    in-memory buffers of ``numel`` (one sub-group) and scaled: the median of
    ``repeats`` steps, fp32 gradients (the reduced gradients' dtype) and,
    in bf16, the bf16 parameters written in the same pass."""
    config = zo.AdamConfig(lr=ADAM["lr"], betas=ADAM["betas"], eps=ADAM["eps"],
                           weight_decay=ADAM["weight_decay"], decoupled_weight_decay=True)  # fmt: skip
    master, grads = torch.randn(numel) * 0.02, torch.randn(numel) * 1e-3
    exp_avg, exp_avg_sq = torch.zeros(numel), torch.zeros(numel)
    out = torch.empty(numel, dtype=dtype) if dtype != torch.float32 else None
    times = []
    for step in range(1, repeats + 2):
        start = time.perf_counter()
        zo.adam_step_flat(config, step, master, grads, exp_avg, exp_avg_sq, params_out=out, num_threads=threads)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * total / numel


# --- the run ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Round:
    steps: StepFigures
    fio: FioFigures

    @property
    def serial_bound_s(self) -> float:
        return self.steps.read_bytes / self.fio.read_bps + self.steps.written_bytes / self.fio.write_bps

    @property
    def overlapped_bound_s(self) -> float:
        return max(self.steps.read_bytes / self.fio.read_bps, self.steps.written_bytes / self.fio.write_bps)

    @property
    def ratio(self) -> float:
        return self.serial_bound_s / self.steps.step_s


def check_directory(path: Path, need_bytes: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(path).free
    if free < need_bytes:
        raise SystemExit(f"{path} has {free / 1e9:.1f} GB free; this run needs about {need_bytes / 1e9:.1f} GB "
                         "(the swap file and fio's two files): give a smaller --params or another --nvme-path")


@dataclass(frozen=True)
class Setting:
    """What the table's header says about the engine's side of the run."""

    params: int
    layers: int
    width: int
    sub_groups: list[int]  # elements of each (non-empty) sub-group
    filesystem: str
    backend: str  # of the optimizer's swap manager: "libaio" (O_DIRECT) or "threadpool"
    adam_threads: int


def main() -> None:
    args = parse_args()
    dtype = DTYPES[args.dtype]
    version = fio_version()
    drop, page_cache = page_cache_dropper(not args.no_drop_caches)
    check_directory(args.nvme_path, 3 * STATE_BYTES * args.params + (1 << 30))
    scratch = args.nvme_path / f"run-{time.time_ns()}"
    scratch.mkdir()
    try:
        setting, rounds = run(args, scratch, dtype, drop)
        elements = setting.sub_groups
        adam_s = adam_seconds(max(elements), sum(elements), dtype, setting.adam_threads, args.adam_repeats)
        describe(args, setting, version, page_cache)
        table(rounds, adam_s)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def run(args: argparse.Namespace, scratch: Path, dtype: torch.dtype, drop: Callable[[], None]) -> tuple[Setting, list[Round]]:
    """Builds the engine, warms up, then times the rounds (steps, then fio);
    the engine is destroyed (its swap file removed) before returning."""
    torch.manual_seed(0)
    model = linear_stack(args.params, args.width)
    width, layers = model[0].in_features, len(model)
    params = sum(p.numel() for p in model.parameters())
    engine, *_ = zcore.initialize(model=model, config=engine_config(args, scratch))
    del model
    try:
        master = engine.optimizer.master
        timer = TimedUpdate(engine.optimizer.update)
        engine.optimizer.update = timer
        for _ in range(args.warmup):
            train_micro_step(engine, width, dtype)
            engine.step()
        state_bytes = master.numel() * STATE_BYTES
        fio = Fio(scratch, state_bytes, state_bytes, args.block_size, args.queue_depth)
        rounds = []
        for r in range(args.rounds):
            drop()
            steps = time_steps(engine, timer, width, dtype, args.steps)
            rounds.append(Round(steps, fio.measure(drop)))
            print(f"  round {r + 1}: step {steps.step_s:.3f} s, serial bound {rounds[-1].serial_bound_s:.3f} s",
                  flush=True)
        setting = Setting(
            params=params, layers=layers, width=width,
            sub_groups=[s.numel for s in master.sub_groups if s.numel > 0],
            filesystem=filesystem_of(scratch), backend=master.swap.backend,
            adam_threads=engine.optimizer.inner.num_threads or torch.get_num_threads(),
        )  # fmt: skip
    finally:
        engine.destroy()
    return setting, rounds


def describe(args: argparse.Namespace, s: Setting, fio: str, page_cache: str) -> None:
    elements = sum(s.sub_groups)
    direct = "O_DIRECT" if s.backend == "libaio" else "through the page cache: NOT the disk"
    print(f"\nOptimizer step on NVMe: {s.params / 1e6:.1f}M parameters ({s.layers} x Linear({s.width}, {s.width}), "
          f"no bias), {args.dtype} compute, stage {args.stage}, world 1, AdamW")
    print(f"optimizer states: {elements * STATE_BYTES / 1e9:.3f} GB ({STATE_BYTES} B/element) in "
          f"{len(s.sub_groups)} sub-group(s) of up to {max(s.sub_groups) / 1e6:.2f}M elements; swap file under "
          f"{args.nvme_path} ({s.filesystem}, {s.backend} backend, {direct})")
    print(f"aio: block {args.block_size >> 10} KiB, queue depth {args.queue_depth}, 1 thread; "
          f"{fio}: libaio, O_DIRECT, same block size and queue depth, 1 job per direction")
    print(f"CPU Adam: {s.adam_threads} thread(s), SIMD {zo.cpu_isa()}; torch {torch.__version__}")
    print(f"{page_cache}; zcore and fio both use O_DIRECT, which bypasses it")
    if s.filesystem in ("tmpfs", "ramfs"):
        print(f"WARNING: {args.nvme_path} is on {s.filesystem}: these figures measure memory, not a disk")
    print(f"{args.warmup} warm-up step(s), then {args.rounds} round(s) of {args.steps} timed step(s) and fio\n")


def table(rounds: list[Round], adam_s: float) -> None:
    gb = 1e9
    print("| round | step s | update stream s | read GB/step | written GB/step | achieved GB/s | fio read GB/s "
          "| fio write GB/s | fio at once r/w GB/s | serial bound s | overlapped bound s | fio at once s "
          "| serial bound / step |")
    print("| --- |" + " ---: |" * 12)
    for i, r in enumerate(rounds, 1):
        s, f = r.steps, r.fio
        print(f"| {i} | {s.step_s:.3f} | {s.update_s:.3f} | {s.read_bytes / gb:.3f} | {s.written_bytes / gb:.3f} "
              f"| {(s.read_bytes + s.written_bytes) / s.step_s / gb:.2f} | {f.read_bps / gb:.2f} "
              f"| {f.write_bps / gb:.2f} | {f.both_read_bps / gb:.2f} / {f.both_write_bps / gb:.2f} "
              f"| {r.serial_bound_s:.3f} | {r.overlapped_bound_s:.3f} | {f.both_s:.3f} | {r.ratio:.2f}x |")
    step = statistics.median(r.steps.step_s for r in rounds)
    ratio = statistics.median(r.ratio for r in rounds)
    print(f"\nmedian over rounds: step {step:.3f} s, serial bound / step {ratio:.2f}x "
          f"(target >= 0.8x: {'met' if ratio >= 0.8 else 'NOT met'}); "
          f"overlapped bound / step {statistics.median(r.overlapped_bound_s / r.steps.step_s for r in rounds):.2f}x")
    check(rounds)
    verdict = "compute-bound" if adam_s > statistics.median(r.serial_bound_s for r in rounds) else "disk-bound"
    print(f"CPU Adam alone on the same elements (in memory, one sub-group timed, scaled): {adam_s:.3f} s per step "
          f"= {adam_s / step:.0%} of the step; the serial disk bound is "
          f"{statistics.median(r.serial_bound_s for r in rounds):.3f} s: {verdict}")


def check(rounds: list[Round]) -> None:
    """The process's own I/O during the steps against the swap file's
    counters: other I/O in the step (gradient shards on NVMe at stages 2-3,
    say) would make the bound too small."""
    counted = sum(r.steps.read_bytes + r.steps.written_bytes for r in rounds)
    process = sum(r.steps.process_read + r.steps.process_written for r in rounds)
    line = (f"cross-check: the process read and wrote {process / len(rounds) / 1e9:.3f} GB per step "
            f"(/proc/self/io), the optimizer's swap file {counted / len(rounds) / 1e9:.3f} GB")
    if abs(process - counted) > 0.02 * counted:
        line += ": OTHER I/O IS IN THE STEP, the bound above leaves it out"
    print(line)


def fio_version() -> str:
    if shutil.which("fio") is None:
        raise SystemExit("fio is not installed (apt-get install fio): this benchmark measures against it")
    return subprocess.run(["fio", "--version"], capture_output=True, text=True, check=True).stdout.strip()


if __name__ == "__main__":
    main()
