"""Replay ZeRO-3's gather/release pattern on GPT shapes through the contiguous allocator.

ZeRO-3 gathers each module's parameters just before the module runs and
releases them afterwards. This script builds that sequence of allocations for
real model shapes and measures two things:

(a) the arena capacity the whole replay needs, as a ratio to the peak of live
    bytes: with zcore's best-fit allocator as is, with compaction whenever an
    allocation fails while enough bytes are free, with the persistent groups
    in a second arena of their own, and with a naive first-fit allocator
    without coalescing (a peer written here);
(b) allocate/free latency per call for the same sequence of sizes: zcore
    through Python (``_C.ContiguousAllocator`` and ``zcore.Arena``), torch's
    CPU allocator (``torch.empty`` + drop) and the native figure from
    ``bench_allocator --replay_trace`` when that binary is built.

The pattern, per training step: forward in module order, then backward in
reverse. Parameter groups are each module's own parameters (GPT-2 layout:
embedding = wte + wpe; per layer ln_1, attn.c_attn, attn.c_proj, ln_2,
mlp.c_fc, mlp.c_proj; ln_f; the LM head, whose weight is wte), gathered as
bf16. At each module the group itself and the next ``prefetch`` groups are
gathered (if not gathered already), then the module's group is released
unless the prefetch window still needs it or it is persistent: groups with
fewer than ``persistence_threshold`` elements (DeepSpeed's
stage3_param_persistence_threshold) stay gathered until the step ends.
The embedding and the tied LM head are separate groups: they sit 6L+1
modules apart, so the window never holds both.

    .venv/bin/python bench/arena_replay.py
"""

from __future__ import annotations

import argparse
import bisect
import gc
import json
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

import zcore
from zcore import _C

BF16_BYTES = 2
MIB = 1 << 20
DEFAULT_BENCH_BINARY = Path(__file__).resolve().parent.parent / "build/py/bench/cpp/bench_allocator"


@dataclass(frozen=True)
class GptConfig:
    name: str
    vocab: int
    positions: int
    d: int
    layers: int


MODELS = {
    "gpt2-small": GptConfig("gpt2-small", vocab=50257, positions=1024, d=768, layers=12),
    # GPT-3 XL's shape (Brown et al. 2020): 1.3B parameters.
    "gpt-1.3b": GptConfig("gpt-1.3b", vocab=50257, positions=2048, d=2048, layers=24),
}


@dataclass(frozen=True)
class Group:
    name: str
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * BF16_BYTES


def parameter_groups(cfg: GptConfig) -> list[Group]:
    """Each module's own parameters, in forward order (weights and biases, GPT-2 layout)."""
    d = cfg.d
    groups = [Group("embedding", cfg.vocab * d + cfg.positions * d)]
    for i in range(cfg.layers):
        groups += [
            Group(f"h{i}.ln_1", 2 * d),
            Group(f"h{i}.attn.c_attn", d * 3 * d + 3 * d),
            Group(f"h{i}.attn.c_proj", d * d + d),
            Group(f"h{i}.ln_2", 2 * d),
            Group(f"h{i}.mlp.c_fc", d * 4 * d + 4 * d),
            Group(f"h{i}.mlp.c_proj", 4 * d * d + d),
        ]
    groups += [Group("ln_f", 2 * d), Group("lm_head(wte)", cfg.vocab * d)]
    return groups


def model_parameters(groups: list[Group]) -> int:
    """Distinct parameters: the LM head re-uses wte, which the embedding group holds."""
    return sum(g.numel for g in groups if g.name != "lm_head(wte)")


# One allocator call: allocate `nbytes` into `slot`, or free `slot` (nbytes 0).
@dataclass(frozen=True)
class Op:
    allocate: bool
    slot: int
    nbytes: int


@dataclass(frozen=True)
class ReplaySpec:
    steps: int
    prefetch: int
    persistence_threshold: int


def gather_trace(groups: list[Group], spec: ReplaySpec) -> list[Op]:
    """The allocate/free calls of ``spec.steps`` ZeRO-3 steps; slot = group index."""
    order = list(range(len(groups))) + list(reversed(range(len(groups))))
    persistent = {i for i, g in enumerate(groups) if g.numel < spec.persistence_threshold}
    ops: list[Op] = []
    for _ in range(spec.steps):
        gathered: set[int] = set()
        for t, current in enumerate(order):
            for wanted in order[t : t + spec.prefetch + 1]:
                if wanted not in gathered:
                    gathered.add(wanted)
                    ops.append(Op(True, wanted, groups[wanted].nbytes))
            still_needed = current in order[t + 1 : t + spec.prefetch + 1]
            if current not in persistent and not still_needed:
                gathered.remove(current)
                ops.append(Op(False, current, 0))
        ops += [Op(False, slot, 0) for slot in sorted(gathered)]
    return ops


def peak_live_bytes(ops: list[Op]) -> int:
    live, peak, sizes = 0, 0, {}
    for op in ops:
        if op.allocate:
            sizes[op.slot] = op.nbytes
            live += op.nbytes
            peak = max(peak, live)
        else:
            live -= sizes.pop(op.slot)
    return peak


class FirstFitFull(MemoryError):
    """The peer's counterpart of zcore.OutOfArenaError."""


# What a full arena raises, zcore's or the peer's.
ARENA_FULL = (zcore.OutOfArenaError, FirstFitFull)


class FirstFitArena:
    """Peer: first fit in offset order, freed ranges are never coalesced."""

    def __init__(self, capacity: int) -> None:
        self._free = [(0, capacity)]  # (offset, bytes), in offset order
        self._live: dict[int, tuple[int, int]] = {}
        self._next = 1

    def allocate(self, nbytes: int, alignment: int) -> int:
        for i, (offset, size) in enumerate(self._free):
            start = -(-offset // alignment) * alignment
            if start - offset + nbytes <= size:
                rest = [(offset, start - offset)] if start > offset else []
                if start + nbytes < offset + size:
                    rest.append((start + nbytes, offset + size - start - nbytes))
                self._free[i : i + 1] = rest
                handle, self._next = self._next, self._next + 1
                self._live[handle] = (start, nbytes)
                return handle
        raise FirstFitFull(f"first fit: no free range holds {nbytes} bytes")

    def free(self, handle: int) -> None:
        bisect.insort(self._free, self._live.pop(handle))


@dataclass(frozen=True)
class ReplayOutcome:
    ok: bool
    compactions: int = 0
    bytes_moved: int = 0


def replay(ops: list[Op], arena, alignment: int, defragment: bool) -> ReplayOutcome:
    """Runs ``ops`` on ``arena``; with ``defragment``, compacts and retries an
    allocation that fails while enough bytes are free (moves are counted, not made)."""
    handles: dict[int, object] = {}
    compactions = moved = 0
    for op in ops:
        if not op.allocate:
            arena.free(handles.pop(op.slot))
            continue
        try:
            handles[op.slot] = arena.allocate(op.nbytes, alignment)
        except ARENA_FULL:
            if not defragment or arena.stats().free < op.nbytes:
                return ReplayOutcome(False)
            moves = arena.defragment()
            compactions += 1
            moved += sum(m.bytes for m in moves)
            try:
                handles[op.slot] = arena.allocate(op.nbytes, alignment)
            except ARENA_FULL:
                return ReplayOutcome(False)
    return ReplayOutcome(True, compactions, moved)


@dataclass(frozen=True)
class Strategy:
    label: str
    make: Callable[[int], object]
    defragment: bool


class SplitArenas:
    """Two zcore arenas: persistent groups (under ``small_limit`` bytes) in one of
    exactly their aligned total, everything else in the rest of the capacity, so
    long-lived small blocks never sit between the large ones."""

    def __init__(self, capacity: int, small_capacity: int, small_limit: int) -> None:
        self._small = _C.ContiguousAllocator(small_capacity)
        self._main = _C.ContiguousAllocator(capacity - small_capacity)
        self._limit = small_limit

    def allocate(self, nbytes: int, alignment: int) -> tuple[_C.ContiguousAllocator, int]:
        arena = self._small if nbytes < self._limit else self._main
        return arena, arena.allocate(nbytes, alignment)

    def free(self, handle: tuple[_C.ContiguousAllocator, int]) -> None:
        arena, native = handle
        arena.free(native)


def strategies(groups: list[Group], threshold: int, alignment: int) -> list[Strategy]:
    """The allocators compared; the first two are the ones the issue asks about."""
    persistent = [g.nbytes for g in groups if g.numel < threshold]
    small_capacity = sum(-(-n // alignment) * alignment for n in persistent)
    found = [
        Strategy("zcore best fit, no defragmentation", _C.ContiguousAllocator, False),
        Strategy("zcore best fit + defragment on failure", _C.ContiguousAllocator, True),
        Strategy("peer: first fit, no coalescing", FirstFitArena, False),
    ]
    if persistent:
        found.insert(
            2,
            Strategy(
                "zcore best fit, persistent groups in 2nd arena",
                lambda capacity: SplitArenas(capacity, small_capacity, threshold * BF16_BYTES),
                False,
            ),
        )
    return found


def fits(ops: list[Op], strategy: Strategy, alignment: int, capacity: int) -> bool:
    return replay(ops, strategy.make(capacity), alignment, strategy.defragment).ok


def smallest_capacity(ops: list[Op], strategy: Strategy, alignment: int, peak: int) -> int:
    """Binary search for the smallest capacity at which the whole replay succeeds.

    Exact only if success is monotone in capacity; ``scan_capacities`` checks.
    """
    high = peak
    while not fits(ops, strategy, alignment, high):
        high *= 2
    low = peak - 1  # no capacity below the peak of live bytes can work
    while high - low > 1:
        mid = (low + high) // 2
        if fits(ops, strategy, alignment, mid):
            high = mid
        else:
            low = mid
    return high


SCAN_PROBES = 600


@dataclass(frozen=True)
class Scan:
    """Evenly spaced capacities from the peak to 1.5x the binary-search result."""

    first_fit: Optional[int]  # smallest probe at which the replay succeeds
    fits_from: Optional[int]  # smallest probe from which every larger probe succeeds


def scan_capacities(
    ops: list[Op], strategy: Strategy, alignment: int, peak: int, found: int
) -> Scan:
    top = found * 3 // 2
    probes = [peak + (top - peak) * k // SCAN_PROBES for k in range(SCAN_PROBES + 1)]
    ok = [fits(ops, strategy, alignment, c) for c in probes]
    first_fit = next((c for c, good in zip(probes, ok) if good), None)
    fits_from = None
    for c, good in zip(reversed(probes), reversed(ok)):
        if not good:
            break
        fits_from = c
    return Scan(first_fit, fits_from)


@dataclass(frozen=True)
class CapacityRow:
    label: str
    capacity: int
    outcome: ReplayOutcome
    scan: Optional[Scan]


def measure_capacity(
    ops: list[Op], compared: list[Strategy], alignment: int, peak: int
) -> list[CapacityRow]:
    rows = []
    for strategy in compared:
        capacity = smallest_capacity(ops, strategy, alignment, peak)
        outcome = replay(ops, strategy.make(capacity), alignment, strategy.defragment)
        scan = scan_capacities(ops, strategy, alignment, peak, capacity)
        rows.append(CapacityRow(strategy.label, capacity, outcome, scan))
    # Compaction at the target ratio: what 5% of slack saves in moves.
    target = -(-peak * 105 // 100)
    defrag = compared[1]
    outcome = replay(ops, defrag.make(target), alignment, True)
    rows.append(CapacityRow(f"{defrag.label}, at 1.05 x peak", target, outcome, None))
    return rows


def print_table_head(title: str, header: str) -> None:
    print(title)
    print(header)
    print("-" * len(header))


def print_capacity_table(rows: list[CapacityRow], peak: int, steps: int) -> None:
    print_table_head(
        f"(a) arena capacity needed (peak of live bytes {peak / MIB:.2f} MiB = {peak} B)",
        f"{'allocator':<54} {'capacity MiB':>12} {'/ peak':>7} {'scan: min ok':>12} "
        f"{'ok from':>8} {'compactions/step':>16} {'MiB moved/step':>14}",
    )

    def ratio(capacity: Optional[int]) -> str:
        return "-" if capacity is None else f"{capacity / peak:.4f}"

    for row in rows:
        scan = row.scan or Scan(None, None)
        moved = row.outcome.bytes_moved / steps / MIB
        ok = "" if row.outcome.ok else "  (replay fails)"
        print(
            f"{row.label:<54} {row.capacity / MIB:>12.2f} {row.capacity / peak:>7.4f} "
            f"{ratio(scan.first_fit):>12} {ratio(scan.fits_from):>8} "
            f"{row.outcome.compactions / steps:>16.2f} {moved:>14.2f}{ok}"
        )
    print(
        "capacity: binary search (assumes success is monotone in capacity). scan: "
        f"{SCAN_PROBES + 1} capacities from the peak to 1.5x that, as / peak: the smallest at "
        "which the replay succeeds, and the smallest from which all larger ones succeed."
    )


# ---------------------------------------------------------------- latency


@dataclass(frozen=True)
class Latency:
    alloc_ns: float  # per-call timers (include the timer and loop overhead)
    free_ns: float
    wall_ns: float  # one timer around the whole pass, divided by the calls
    cpu_ns: float


def time_calls(
    ops: list[Op], alloc: Callable[[int], object], free: Callable[[object], None], reps: int
) -> Latency:
    """Best of ``reps`` passes over ``ops``. The free call is followed by
    dropping the slot's reference, which is where a torch tensor is freed."""
    slots: list[object] = [None] * (max(op.slot for op in ops) + 1)
    calls = len(ops)
    n_alloc = sum(op.allocate for op in ops)
    best = [float("inf")] * 4
    clock = time.perf_counter_ns
    gc.disable()
    try:
        for _ in range(reps):
            alloc_total = free_total = 0
            for op in ops:
                if op.allocate:
                    t0 = clock()
                    slots[op.slot] = alloc(op.nbytes)
                    alloc_total += clock() - t0
                else:
                    t0 = clock()
                    free(slots[op.slot])
                    slots[op.slot] = None
                    free_total += clock() - t0
            wall0, cpu0 = clock(), time.process_time_ns()
            for op in ops:
                if op.allocate:
                    slots[op.slot] = alloc(op.nbytes)
                else:
                    free(slots[op.slot])
                    slots[op.slot] = None
            wall, cpu = clock() - wall0, time.process_time_ns() - cpu0
            n_free = calls - n_alloc
            sample = [alloc_total / n_alloc, free_total / n_free, wall / calls, cpu / calls]
            best = [min(b, s) for b, s in zip(best, sample)]
    finally:
        gc.enable()
    return Latency(*best)


Peers = dict[str, tuple[Callable[[int], object], Callable[[object], None]]]


def python_peers(capacity: int, alignment: int) -> tuple[Peers, zcore.Arena]:
    native = _C.ContiguousAllocator(capacity)
    arena = zcore.Arena.on_host(capacity)

    def arena_alloc(nbytes: int) -> zcore.Block:
        return arena.allocate((nbytes // BF16_BYTES,), torch.bfloat16, alignment)

    def arena_alloc_view(nbytes: int) -> tuple[zcore.Block, torch.Tensor]:
        block = arena_alloc(nbytes)
        return block, arena.tensor(block)

    def torch_alloc(nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def nothing(_: object) -> None:
        return None

    peers = {
        "python loop floor (no allocator)": (lambda nbytes: nbytes, nothing),
        "zcore _C.ContiguousAllocator": (
            lambda nbytes: native.allocate(nbytes, alignment),
            native.free,
        ),
        "zcore.Arena (Block)": (arena_alloc, arena.free),
        "zcore.Arena (Block + tensor view)": (arena_alloc_view, lambda bv: arena.free(bv[0])),
        "torch.empty(uint8) + drop": (torch_alloc, nothing),
    }
    return peers, arena


def native_latency(
    binary: Path, ops: list[Op], capacity: int, alignment: int, min_time: float
) -> Optional[Latency]:
    """BM_ReplayTrace over the same calls, or None when the binary is not built."""
    if not binary.is_file():
        return None
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.txt"
        lines = [f"capacity {capacity}"]
        lines += [
            f"a {op.slot} {op.nbytes} {alignment}" if op.allocate else f"f {op.slot}"
            for op in ops
        ]
        trace.write_text("\n".join(lines) + "\n")
        result = subprocess.run(
            [
                str(binary),
                f"--replay_trace={trace}",
                "--benchmark_filter=^BM_ReplayTrace$",
                f"--benchmark_min_time={min_time}",
                "--benchmark_format=json",
            ],
            check=True,
            capture_output=True,
            text=True,
        )
    run = json.loads(result.stdout)["benchmarks"][0]
    if run.get("error_occurred"):
        raise RuntimeError(f"bench_allocator --replay_trace failed: {run.get('error_message')}")
    scale = {"ns": 1.0, "us": 1e3, "ms": 1e6, "s": 1e9}[run["time_unit"]]
    calls = len(ops)
    nan = float("nan")
    return Latency(nan, nan, run["real_time"] * scale / calls, run["cpu_time"] * scale / calls)


def print_latency_table(rows: dict[str, Optional[Latency]], calls: int, binary: Path) -> None:
    print_table_head(
        f"(b) allocate/free latency, ns per call, same {calls} calls (best pass)",
        f"{'implementation':<40} {'alloc':>9} {'free':>9} "
        f"{'per call wall':>14} {'per call CPU':>13}",
    )
    for label, lat in rows.items():
        if lat is None:
            print(f"{label:<40} not built: {binary} is missing (build with ZCORE_BUILD_BENCH=ON)")
            continue
        cells = ["-" if x != x else f"{x:.0f}" for x in (lat.alloc_ns, lat.free_ns)]
        print(f"{label:<40} {cells[0]:>9} {cells[1]:>9} {lat.wall_ns:>14.0f} {lat.cpu_ns:>13.0f}")
    print(
        "alloc/free: per-call perf_counter timers around each call (timer and loop overhead "
        "included, see the floor row); per call: one timer around a whole pass."
    )


def measure_latency(
    ops: list[Op], capacity: int, args: argparse.Namespace
) -> dict[str, Optional[Latency]]:
    peers, arena = python_peers(capacity, args.alignment)
    rows: dict[str, Optional[Latency]] = {
        label: time_calls(ops, alloc, free, args.reps) for label, (alloc, free) in peers.items()
    }
    if arena.generation != 0:
        raise RuntimeError(
            "zcore.Arena compacted during the latency run; its capacity is too small"
        )
    rows["zcore native (bench_allocator, C++)"] = native_latency(
        args.bench_binary, ops, capacity, args.alignment, args.min_time
    )
    return rows


def run_model(cfg: GptConfig, args: argparse.Namespace) -> None:
    groups = parameter_groups(cfg)
    spec = ReplaySpec(args.steps, args.prefetch, args.persistence_threshold)
    ops = gather_trace(groups, spec)
    peak = peak_live_bytes(ops)
    persistent = sum(g.numel < spec.persistence_threshold for g in groups)
    print(
        f"== {cfg.name}: vocab {cfg.vocab}, positions {cfg.positions}, d {cfg.d}, "
        f"{cfg.layers} layers, {model_parameters(groups) / 1e6:.1f}M parameters, "
        f"{len(groups)} groups ({persistent} persistent)"
    )
    print(
        f"   {spec.steps} steps, prefetch {spec.prefetch}, persistence threshold "
        f"{spec.persistence_threshold} elements, alignment {args.alignment} B, {len(ops)} calls"
    )
    compared = strategies(groups, spec.persistence_threshold, args.alignment)
    capacity_rows = measure_capacity(ops, compared, args.alignment, peak)
    print_capacity_table(capacity_rows, peak, spec.steps)
    # The capacity best fit needs without compaction: no run below moves bytes.
    latency = measure_latency(ops, capacity_rows[0].capacity, args)
    print_latency_table(latency, len(ops), args.bench_binary)
    print()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=[*MODELS, "all"], default="all")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prefetch", type=int, default=2, help="groups gathered ahead of use")
    parser.add_argument(
        "--persistence-threshold",
        type=float,
        default=1e5,
        help="groups with fewer elements stay gathered for the step (0 disables)",
    )
    parser.add_argument("--alignment", type=int, default=zcore.memory.arena.DEFAULT_ALIGNMENT)
    parser.add_argument("--reps", type=int, default=20, help="timed passes per implementation")
    parser.add_argument("--bench-binary", type=Path, default=DEFAULT_BENCH_BINARY)
    parser.add_argument(
        "--min-time", type=float, default=0.2, help="bench_allocator --benchmark_min_time"
    )
    args = parser.parse_args()
    args.persistence_threshold = int(args.persistence_threshold)
    return args


def main() -> None:
    args = parse_args()
    models = MODELS.values() if args.model == "all" else [MODELS[args.model]]
    for cfg in models:
        run_model(cfg, args)


if __name__ == "__main__":
    main()
