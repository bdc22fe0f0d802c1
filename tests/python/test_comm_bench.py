"""``zcore bench-comm``: every size measured for both collectives, the
bucket size at 90% of peak among them, a broken collective refused rather
than timed, and the command through torch's launcher."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distributed import run_ranks

KIB = 2**10


def table_sizes(text: str) -> list[str]:
    """The size column of the report's table."""
    return [" ".join(line.split()[:2]) for line in text.splitlines() if line.split()[1:2] in (["KiB"], ["MiB"])]


def bench(rank: int, world: int) -> tuple[list[int], list, str]:
    from zcore.comm import collectives as comm
    from zcore.observe.comm_bench import measure, message_sizes, report

    comm.init_distributed()
    sizes = message_sizes(4 * KIB, 64 * KIB, world, torch.float32)
    results = measure(sizes, torch.float32, iters=3, warmup=1)
    return sizes, results, report(results, torch.float32, 3, 1)


def test_every_size_is_measured_and_the_bucket_size_is_at_90_percent_of_peak() -> None:
    from zcore.observe.comm_bench import ALL_GATHER, REDUCE_SCATTER, at_peak_fraction

    (sizes, results, text), (_, other, _) = run_ranks(bench, 2, timeout=120)
    assert sizes == [4 * KIB, 8 * KIB, 16 * KIB, 32 * KIB, 64 * KIB]
    assert [r.seconds for r in results] == [r.seconds for r in other]  # the slowest rank's, on every rank
    for collective in (ALL_GATHER, REDUCE_SCATTER):
        mine = [r for r in results if r.collective == collective]
        assert [r.nbytes for r in mine] == sizes
        assert all(r.seconds > 0 and r.algbw > 0 and r.busbw == pytest.approx(r.algbw / 2) for r in mine)
        knee = at_peak_fraction(results, collective)
        assert knee in mine
        assert knee.algbw >= 0.9 * max(r.algbw for r in mine)
        assert all(r.algbw < 0.9 * max(r.algbw for r in mine) for r in mine if r.nbytes < knee.nbytes)
        assert f"{collective} reaches 90% of its peak" in text
        assert f"at least {knee.nbytes // 4:,}" in text
    assert table_sizes(text) == ["4 KiB", "8 KiB", "16 KiB", "32 KiB", "64 KiB"]
    assert "busbw = algbw * (n-1)/n" in text
    assert "reduce_bucket_size" in text and "stage3_prefetch_bucket_size" in text


def bench_broken_gather(rank: int, world: int) -> str:
    """Rank 1's all-gather delivers one wrong element."""
    from zcore.comm import collectives as comm
    from zcore.observe.comm_bench import measure

    comm.init_distributed()
    real = comm.all_gather_into

    def broken(output, shard, async_op=False):
        real(output, shard)
        if rank == 1:
            output[3] += 1

    comm.all_gather_into = broken
    try:
        measure([4 * KIB], torch.float32, iters=1, warmup=0)
    except RuntimeError as exc:
        return str(exc)
    return "measured"


def test_a_broken_collective_fails_the_bench_on_every_rank() -> None:
    on_rank0, on_rank1 = run_ranks(bench_broken_gather, 2, timeout=120)
    assert "all_gather_into gave wrong values on rank 1" in on_rank1
    assert "element 3 is 4.0, expected 3.0" in on_rank1
    assert "failed on rank 1" in on_rank0 and "all_gather_into gave wrong values" in on_rank0


def test_sizes_are_whole_elements_on_every_rank() -> None:
    from zcore.observe.comm_bench import message_sizes
    from zcore.errors import InvalidArgumentError

    assert message_sizes(1, 100, 3, torch.bfloat16) == [6, 12, 30, 60]  # 1, 2, 4 and 8 bytes round to 6
    with pytest.raises(InvalidArgumentError, match="at most the largest"):
        message_sizes(2 * KIB, KIB, 2, torch.float32)


def test_the_command_starts_its_ranks_through_the_launcher() -> None:
    zcore_cli = Path(sys.executable).with_name("zcore")
    done = subprocess.run(
        [str(zcore_cli), "bench-comm", "--min-size", "4KiB", "--max-size", "16KiB", "--iters", "2", "--warmup", "1"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "zcore bench-comm: 2 ranks, gloo, float32" in done.stdout
    assert table_sizes(done.stdout) == ["4 KiB", "8 KiB", "16 KiB"]
    assert done.stdout.count("reaches 90% of its peak") == 2
