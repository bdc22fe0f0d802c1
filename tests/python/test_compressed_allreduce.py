"""The 1-bit all-reduce with error feedback (zcore.comm.compressed_allreduce), on
2 and 4 gloo ranks, against a single-process reference written here from
the algorithm's description: every worker and every server simulated, no
bit packing, no messages. Then the error-feedback identity, which holds
exactly (to float rounding) whatever the compression loses: summed over T
calls, the outputs equal the true means minus the mean worker error and
the server errors, so the average output error falls as 1/T.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from zcore.comm import collectives as comm
from zcore.comm.compressed_allreduce import ErrorFeedback, compressed_all_reduce, padded_numel

SIZES = (1, 37, 1000, 0, 4096)  # one element, ragged, several chunks, empty, already aligned
ROUNDS = 4


def inputs(round_: int, rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 * round_ + rank)
    return [torch.randn(n, generator=g) * (1 + rank) for n in SIZES]


def reference_round(
    xs: list[torch.Tensor], workers: list[torch.Tensor], servers: list[torch.Tensor]
) -> torch.Tensor:
    """One tensor, one call, every rank simulated: ``xs[r]`` is rank r's
    input, ``workers[r]`` its worker error, ``servers[j]`` server j's error
    (all updated in place). Returns the output every rank receives."""
    world, n = len(xs), xs[0].numel()
    padded = workers[0].numel()
    decoded = []
    for x, worker in zip(xs, workers):
        v = torch.zeros(padded)
        v[:n] = x
        v += worker
        scale = v.norm() / math.sqrt(padded)
        signs = torch.where(v < 0, -1.0, 1.0)
        worker.copy_(v - scale * signs)
        decoded.append(scale * signs)
    chunk = padded // world
    out = torch.empty(padded)
    for j, server in enumerate(servers):
        part = slice(j * chunk, (j + 1) * chunk)
        m = sum(d[part] for d in decoded) / world + server
        scale = m.norm() / math.sqrt(chunk)
        signs = torch.where(m < 0, -1.0, 1.0)
        server.copy_(m - scale * signs)
        out[part] = scale * signs
    return out[:n]


def run_rounds(rank: int, world: int) -> dict:
    dist.init_process_group("gloo")
    errors = [ErrorFeedback.zeros(n, world, torch.device("cpu")) for n in SIZES]
    outputs = []
    for r in range(ROUNDS):
        tensors = inputs(r, rank)
        compressed_all_reduce(tensors, errors)
        outputs.append(tensors)
    return {"outputs": outputs, "workers": [e.worker for e in errors], "servers": [e.server for e in errors]}


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_gets_the_references_output_and_keeps_its_errors(world):
    got = run_ranks(run_rounds, world, timeout=120)
    for i, n in enumerate(SIZES):
        if n == 0:  # nothing to send: skipped, as DeepSpeed skips it
            assert all(g["outputs"][r][i].numel() == 0 for g in got for r in range(ROUNDS))
            continue
        padded = padded_numel(n, world)
        workers = [torch.zeros(padded) for _ in range(world)]
        servers = [torch.zeros(padded // world) for _ in range(world)]
        for r in range(ROUNDS):
            expected = reference_round([inputs(r, rank)[i] for rank in range(world)], workers, servers)
            for rank in range(world):
                torch.testing.assert_close(got[rank]["outputs"][r][i], expected, rtol=1e-5, atol=1e-6)
        for rank in range(world):
            torch.testing.assert_close(got[rank]["workers"][i], workers[rank], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got[rank]["servers"][i], servers[rank], rtol=1e-5, atol=1e-5)


def feedback_residuals(rank: int, world: int, n: int, rounds: int, marks: list[int]) -> dict:
    """Runs ``rounds`` calls on one tensor whose true mean every rank can
    compute; at each mark, the residual of the identity and the average
    output error."""
    dist.init_process_group("gloo")
    error = ErrorFeedback.zeros(n, world, torch.device("cpu"))
    summed_out = torch.zeros(n, dtype=torch.float64)
    summed_mean = torch.zeros(n, dtype=torch.float64)
    found = {}
    for t in range(1, rounds + 1):
        g = torch.Generator().manual_seed(t)
        everyone = torch.randn(world, n, generator=g) + 0.5  # a bias, as gradients have
        summed_mean += everyone.double().mean(0)
        x = everyone[rank].clone()
        compressed_all_reduce([x], [error])
        summed_out += x.double()
        if t in marks:
            workers = torch.empty(world, error.worker.numel())
            comm.all_gather_into(workers.view(-1), error.worker)
            servers = torch.empty(world, error.server.numel())
            comm.all_gather_into(servers.view(-1), error.server)
            owed = workers.double().mean(0)[:n] + servers.double().reshape(-1)[:n]
            found[t] = {
                "identity": float((summed_out - (summed_mean - owed)).norm() / summed_mean.norm()),
                "average_error": float((summed_out - summed_mean).norm() / t),
                "mean_norm": float(summed_mean.norm() / t),
            }
    return found


@pytest.mark.parametrize("world", [2, 4])
def test_error_feedback_returns_what_compression_withheld(world):
    marks = [20, 400]
    found = run_ranks(feedback_residuals, world, 300, 400, marks, timeout=120)[0]
    for t in marks:
        assert found[t]["identity"] < 1e-5, (t, found[t])  # exact but for float rounding
    early, late = found[20]["average_error"], found[400]["average_error"]
    # The errors stay bounded, so the average error falls as 1/T: 20x fewer
    # calls' worth over 20x the calls, allowing for their variation.
    assert late < early / 5, (early, late)
    assert late < 0.05 * found[400]["mean_norm"]


def test_a_world_of_one_sends_nothing_and_changes_nothing():
    x = torch.randn(10)
    before = x.clone()
    error = ErrorFeedback.zeros(10, 1, torch.device("cpu"))
    compressed_all_reduce([x], [error])  # no process group: a world of one
    assert torch.equal(x, before) and not error.worker.any()


@pytest.mark.parametrize(
    "numel, world, padded",
    [(1, 1, 8), (1, 2, 16), (17, 2, 32), (32, 4, 32), (37, 3, 72), (0, 4, 0), (100, 8, 128), (1, 16, 256)],
)
def test_padding_is_deepspeeds(numel, world, padded):
    """A multiple of world x lcm(world, 8), DeepSpeed's corrected size."""
    assert padded_numel(numel, world) == padded
