"""``zcore bench-comm``: the bandwidth of zcore's all-gather and
reduce-scatter by message size, on the current process group, and the
size at which each reaches 90% of its peak: the bucket size to configure.

It times zcore's own collectives (zcore.comm.collectives), the ones training issues: on
gloo a point-to-point all-gather and an all-to-all reduce-scatter, on NCCL
torch's. Sizes and bandwidths follow nccl-tests: a message is the whole
buffer (the all-gather's output, the reduce-scatter's input); algorithm
bandwidth is size / time; bus bandwidth is algbw * (n - 1) / n for both
collectives, what each rank's link carries, comparable across world sizes.
Every size's first call is checked against the values it must give: a
benchmark of a broken collective would be worthless.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zcore.comm import collectives as comm
from zcore.errors import InvalidArgumentError, InvalidStateError
from zcore.step.units import MAX_UNIT_NUMEL

ALL_GATHER, REDUCE_SCATTER = "all_gather", "reduce_scatter"
PEAK_FRACTION = 0.9

# The zero_optimization keys (in elements) that set the message size of each collective.
_KEYS = {
    ALL_GATHER: "allgather_bucket_size (stages 1-2), stage3_prefetch_bucket_size (stage 3)",
    REDUCE_SCATTER: "reduce_bucket_size (stages 1-2)",
}


@dataclass(frozen=True)
class Measurement:
    collective: str  # ALL_GATHER or REDUCE_SCATTER
    nbytes: int  # the whole buffer: the all-gather's output, the reduce-scatter's input
    seconds: float  # median time of one call on the slowest rank
    world_size: int

    @property
    def algbw(self) -> float:
        """Bytes per second."""
        return self.nbytes / self.seconds

    @property
    def busbw(self) -> float:
        """Bytes per second on each rank's link (nccl-tests' bus bandwidth)."""
        return self.algbw * (self.world_size - 1) / self.world_size


def message_sizes(smallest: int, largest: int, world_size: int, dtype: torch.dtype) -> list[int]:
    """Sizes in bytes doubling from ``smallest`` up to ``largest``, each
    rounded down to whole elements on every rank (and at least one)."""
    if smallest <= 0 or largest < smallest:
        raise InvalidArgumentError(
            f"message sizes from {smallest} to {largest} bytes: the smallest must be positive and at "
            "most the largest; give --min-size and --max-size such as 64KiB and 256MiB"
        )
    step = world_size * dtype.itemsize
    sizes = []
    size = smallest
    while size <= largest:
        sizes.append(max(step, size // step * step))
        size *= 2
    return list(dict.fromkeys(sizes))  # rounding up to one step may repeat the smallest


def measure(
    sizes: Sequence[int], dtype: torch.dtype = torch.float32, iters: int = 20, warmup: int = 5
) -> list[Measurement]:
    """Times zcore's all-gather and reduce-scatter at each size (bytes of
    the whole buffer) on the default process group; call it on every rank.
    Each time is the median of ``iters`` calls after ``warmup`` untimed
    ones, each call started together on every rank (a barrier), taken on
    the slowest rank."""
    if not dist.is_initialized():
        raise InvalidStateError(
            "no process group: call zcore.comm.collectives.init_distributed() first (zcore bench-comm does)"
        )
    world = dist.get_world_size()
    if world < 2:
        raise InvalidArgumentError(
            f"the process group has {world} rank: collectives are measured between ranks; run on 2 or "
            "more (zcore bench-comm --nproc 2, or under torchrun)"
        )
    if iters < 1 or warmup < 0:
        raise InvalidArgumentError(f"{iters=} and {warmup=}: give at least one timed call and no negative warm-up")
    step = world * dtype.itemsize
    uneven = [s for s in sizes if s <= 0 or s % step]
    if uneven:
        raise InvalidArgumentError(
            f"message sizes {uneven} bytes are not whole {dtype} elements on each of {world} ranks (multiples "
            f"of {step} bytes); round them, or take them from message_sizes()"
        )
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    results = []
    for nbytes in sizes:
        full = torch.empty(nbytes // dtype.itemsize, dtype=dtype, device=device)
        shard = torch.empty(full.numel() // world, dtype=dtype, device=device)
        _check_one_round(full, shard)
        gather = _median_seconds(lambda: comm.all_gather_into(full, shard), iters, warmup, device)
        scatter = _median_seconds(lambda: comm.reduce_scatter_sum(shard, full).wait(), iters, warmup, device)
        results.append(Measurement(ALL_GATHER, nbytes, gather, world))
        results.append(Measurement(REDUCE_SCATTER, nbytes, scatter, world))
    return results


def _check_one_round(full: torch.Tensor, shard: torch.Tensor) -> None:
    """One all-gather and one reduce-scatter of known values; raises on
    every rank if any rank got wrong ones."""
    rank, world = dist.get_rank(), dist.get_world_size()
    m = shard.numel()

    def values(r: int, owner: int) -> torch.Tensor:
        """Rank ``r``'s values in slice ``owner`` of the whole buffer: small
        integers, so that sums over ranks are exact in fp32 (and in bf16 and
        fp16 up to 85 and 682 ranks; beyond, within rounding)."""
        positions = torch.arange(owner * m, (owner + 1) * m, device=full.device)
        return ((positions * (2 * r + 1) + r) % 4).to(full.dtype)

    problem = None
    shard.copy_(values(rank, rank))
    comm.all_gather_into(full, shard)
    for owner in range(world):
        got, expected = full[owner * m : (owner + 1) * m], values(owner, owner)
        if problem is None and not torch.equal(got, expected):
            problem = _mismatch("all_gather_into", got, expected, got != expected, owner * m)
    for owner in range(world):
        full[owner * m : (owner + 1) * m].copy_(values(rank, owner))
    comm.reduce_scatter_sum(shard, full).wait()
    total = sum(values(r, rank).double() for r in range(world))
    # Values are non-negative, so partial sums never exceed the total and
    # rounding errs by at most world x eps of it.
    tolerance = world * torch.finfo(full.dtype).eps if full.dtype.is_floating_point else 0.0
    wrong = (shard.double() - total).abs() > tolerance * total
    if problem is None and bool(wrong.any()):
        problem = _mismatch("reduce_scatter_sum", shard, total, wrong, 0)
    comm.raise_if_any_failed(
        None if problem is None else RuntimeError(problem), f"checking zcore's collectives at {full.nbytes} bytes"
    )


def _mismatch(collective: str, got: torch.Tensor, expected: torch.Tensor, wrong: torch.Tensor, offset: int) -> str:
    first = int(wrong.nonzero()[0])
    return (
        f"zcore.comm.collectives.{collective} gave wrong values on rank {dist.get_rank()} "
        f"({dist.get_backend()}, {got.dtype}, "
        f"{got.numel()}-element slices): element {offset + first} is {got[first].item()}, expected "
        f"{expected[first].item()}; the collective is broken here, and its timings would mean nothing"
    )


def _median_seconds(call: Callable[[], None], iters: int, warmup: int, device: torch.device) -> float:
    for _ in range(warmup):
        call()
    times = []
    for _ in range(iters):
        dist.barrier()  # every rank starts together: a late rank's lag is not the collective's time
        _synchronize(device)
        start = time.perf_counter()
        call()
        _synchronize(device)
        times.append(time.perf_counter() - start)
    slowest = torch.tensor(statistics.median(times), dtype=torch.float64, device=device)
    comm.all_reduce_max(slowest)  # a collective is done when its last rank is
    return float(slowest.item())


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def at_peak_fraction(results: Sequence[Measurement], collective: str, fraction: float = PEAK_FRACTION) -> Measurement:
    """The smallest message of ``collective`` whose bandwidth reaches
    ``fraction`` of the highest measured."""
    mine = sorted((r for r in results if r.collective == collective), key=lambda r: r.nbytes)
    if not mine:
        raise InvalidArgumentError(f"no measurement of {collective} among the results")
    peak = max(r.algbw for r in mine)
    return next(r for r in mine if r.algbw >= fraction * peak)


def report(results: Sequence[Measurement], dtype: torch.dtype, iters: int, warmup: int) -> str:
    """The table of sizes and bandwidths, and the bucket size at 90% of
    each collective's peak, with the config keys it is for."""
    world = results[0].world_size
    by_size: dict[int, dict[str, Measurement]] = {}
    for r in results:
        by_size.setdefault(r.nbytes, {})[r.collective] = r
    name = str(dtype).removeprefix("torch.")
    lines = [
        f"zcore bench-comm: {world} ranks, {dist.get_backend()}, {name}; median of {iters} calls after {warmup} "
        "warm-up, on the slowest rank",
        "size: the whole buffer (all-gather output, reduce-scatter input); algbw = size / time;",
        "busbw = algbw * (n-1)/n (nccl-tests' bus bandwidth, for both); GB/s = 1e9 bytes/s",
        "",
        f"{'':>10}  {'all_gather':^32}  {'reduce_scatter':^32}",
        f"{'size':>10}  " + "  ".join([f"{'time (ms)':>10} {'algbw GB/s':>10} {'busbw GB/s':>10}"] * 2),
    ]
    for nbytes, row in sorted(by_size.items()):
        cells = [f"{r.seconds * 1e3:10.3f} {r.algbw / 1e9:10.3f} {r.busbw / 1e9:10.3f}"
                 for r in (row[ALL_GATHER], row[REDUCE_SCATTER])]
        lines.append(f"{_binary(nbytes):>10}  " + "  ".join(cells))
    lines.append("")
    largest = max(by_size)
    for collective in (ALL_GATHER, REDUCE_SCATTER):
        knee = at_peak_fraction(results, collective)
        peak = max(r.algbw for r in results if r.collective == collective)
        elements = knee.nbytes // dtype.itemsize
        lines += [
            f"{collective} reaches {PEAK_FRACTION:.0%} of its peak ({peak / 1e9:.3f} GB/s algbw) at "
            f"{_binary(knee.nbytes)} = {knee.nbytes:,} bytes = {elements:,} {name} elements",
            f"  bucket size in elements, at least {elements:,}: zero_optimization.{_KEYS[collective]}",
        ]
        if knee.nbytes == largest:
            lines.append("  (still rising at the largest size measured: measure larger ones with --max-size)")
        if elements > MAX_UNIT_NUMEL:
            lines.append(
                f"  (stages 1-2 cap their units at {MAX_UNIT_NUMEL:,} elements whatever the bucket sizes: "
                "zcore.step.units.MAX_UNIT_NUMEL)"
            )
    return "\n".join(line.rstrip() for line in lines)


def _binary(nbytes: int) -> str:
    """512 B, 64 KiB, 1.5 MiB."""
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):g} {unit}"
    return f"{nbytes} B"


def run(smallest: int, largest: int, dtype: torch.dtype, iters: int, warmup: int) -> None:
    """``zcore bench-comm`` on one rank of a launched job: joins the group,
    measures, and rank 0 prints the report."""
    context = comm.init_distributed()
    sizes = message_sizes(smallest, largest, context.world_size, dtype)
    results = measure(sizes, dtype, iters, warmup)
    if context.rank == 0:
        print(report(results, dtype, iters, warmup), flush=True)
    dist.barrier()
    dist.destroy_process_group()
