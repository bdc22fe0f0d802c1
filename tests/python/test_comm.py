"""zcore.comm.collectives's collectives on gloo (point-to-point all-gather, all-to-all
reduce-scatter) give what torch.distributed's own give, on 2 and 3 ranks,
for several sizes and dtypes, issued back to back before any is waited;
and a handle can be waited twice, as a torch Work can."""

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks

SIZES = [1, 7, 4096]
DTYPES = [torch.float32, torch.bfloat16, torch.int64]


def shard_of(rank: int, numel: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * salt + rank)
    return (torch.randn(numel, generator=gen) * 100).to(dtype)


def check_collectives(rank, world):
    from zcore.comm import collectives as comm

    comm.init_distributed()
    cases = [(n, d) for n in SIZES for d in DTYPES]
    # Start every collective before waiting for any: messages of different
    # calls must not be mixed up.
    gathers, scatters = [], []
    for salt, (numel, dtype) in enumerate(cases):
        shard = shard_of(rank, numel, dtype, salt)
        out = torch.empty(world * numel, dtype=dtype)
        gathers.append((out, shard, comm.all_gather_into(out, shard, async_op=True)))
        full = shard_of(rank, world * numel, dtype, salt + 100)
        mine = torch.empty(numel, dtype=dtype)
        scatters.append((mine, full.clone(), comm.reduce_scatter_sum(mine, full)))
    for (out, shard, work), (mine, full, rs) in zip(gathers, scatters):
        work.wait()
        rs.wait()
        rs.wait()  # a second wait changes nothing
        expected = [torch.empty_like(shard) for _ in range(world)]
        dist.all_gather(expected, shard)
        assert torch.equal(out, torch.cat(expected))
        total = full.double() if full.is_floating_point() else full.clone()
        dist.all_reduce(total)
        want = total.view(world, -1)[rank]
        if full.is_floating_point():
            # Summed in the input dtype, in rank order on every rank.
            tolerance = 1e-2 if full.dtype == torch.bfloat16 else 1e-5
            torch.testing.assert_close(mine.double(), want, rtol=tolerance, atol=tolerance * 100)
        else:
            assert torch.equal(mine, want)
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_collectives_match_torch(world):
    assert run_ranks(check_collectives, world, timeout=120) == [True] * world
