"""ZeRO-3 ranks whose modules run in different orders fail with an error
naming each rank's module, instead of hanging in mismatched all-gathers:
on the first step (the trace is being recorded), on a later step where
the ranks leave their agreed trace for different modules, and (with
stage3_rank_agreement_check "every_module") where one rank leaves the trace
while the other follows it."""

import pytest
import torch
from torch import nn

import zcore
from distributed import run_ranks

TIMEOUT = 120  # the harness kills the ranks and fails past this


class TwoBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.left = nn.Linear(32, 32)
        self.right = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, branch: str = "") -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if branch:
            h = torch.tanh(getattr(self, branch)(h))
        return self.head(h)


def train_until_failure(rank, world, branches, check="recording"):
    """Trains on ``branches[step][rank]``; returns (step, message) of the failure."""
    torch.manual_seed(0)
    config = {"train_batch_size": 4 * world, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_rank_agreement_check": check}}
    engine, *_ = zcore.initialize(model=TwoBranches(), config=config)
    x = torch.randn(4, 16)
    for step, per_rank in enumerate(branches):
        try:
            engine.backward(engine(x, branch=per_rank[rank]).square().mean())
        except zcore.InvalidStateError as failure:
            return step, str(failure), engine.gather_stats().gathered_bytes
        engine.step()
    return None


@pytest.mark.parametrize(
    "branches, failing_step, check",
    [
        ([("left", "")], 0, "recording"),  # recording: rank 1 skips the branch
        ([("", "")] * 2 + [("left", "right")], 2, "recording"),  # both depart, differently
        # Rank 0 follows its trace while rank 1 departs: only a check at every module sees it.
        ([("", "")] * 2 + [("", "left")], 2, "every_module"),
    ],
    ids=["first step", "departure", "one rank departs"],
)
def test_ranks_running_different_modules_fail_instead_of_hanging(branches, failing_step, check):
    results = run_ranks(train_until_failure, 2, branches, check, timeout=TIMEOUT)
    expected = [branches[failing_step][r] or "head" for r in range(2)]
    for rank, got in enumerate(results):
        assert got is not None, f"rank {rank} trained through"
        step, message, gathered = got
        assert step == failing_step
        assert "ranks diverged" in message, message
        for r, module in enumerate(expected):
            assert f"rank {r}: module '{module}' (Linear)" in message, message
        assert "same modules in the same order" in message, message
        assert gathered == 0  # the failed step released what it had gathered
