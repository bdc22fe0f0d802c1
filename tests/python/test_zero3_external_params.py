"""ZeRO-3 parameters used outside their module without being declared.

Returned by a module (the parameter itself, or a view of it): zcore sees it
in the module's output, hands it to the calling module, and training
matches a single-process AdamW run. Read from another module as an
attribute: zcore cannot see it coming, and declares it at its first use
while the first step records (as DeepSpeed does); training matches torch.
"""


import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zcore
from distributed import run_ranks
from log_capture import capture_zcore_log
from training import assert_matches, train_reference, train_zcore, zcore_config

STEPS = 8
TOLERANCE = 1e-5
# Every group gathered and released per use, so that a parameter not held
# by its user is really gone.
ON_DEMAND = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}


def train_returned(rank, world):
    messages = capture_zcore_log()
    out = train_zcore(rank, world, "returned", zcore_config(3, 1, 0.0, zero=ON_DEMAND), STEPS)
    out["handed_over"] = [m for m in messages.messages if "from a module it called" in m]
    return out


def test_returned_parameters_are_gathered_for_the_caller():
    results = run_ranks(train_returned, 2, timeout=300)
    ref = train_reference("returned", 0.0, STEPS, 2, 1)
    for rank, got in enumerate(results):
        assert_matches(got, ref, TOLERANCE, f"rank {rank}")
        handed = got["handed_over"]
        assert len(handed) == 2, handed  # once each, on the first step
        assert any("the model" in m and "'queries.weight'" in m for m in handed), handed
        assert any("module 'mixer'" in m and "'mixer.proj.weight'" in m for m in handed), handed
        # The callers' next calls gather them on entry: the second step
        # departs from the first one's order, and its order then holds.
        assert got["gather_stats"].trace_recordings == 2


class SiblingWeight(nn.Module):
    """Reads the head's weight as an attribute, after the head has run."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.head(h) + 0.1 * F.linear(h, self.head.weight)


def undeclared_use(rank, world):
    messages = capture_zcore_log()
    torch.manual_seed(0)
    model = SiblingWeight()
    config = {"train_batch_size": 4 * world, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, **ON_DEMAND}}
    engine, *_ = zcore.initialize(model=model, config=config)
    x = torch.randn(4, 16)
    losses = []
    for _ in range(3):
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    declared = [m for m in messages.messages if "neither owns nor declared" in m]
    return declared, engine.gather_stats().trace_recordings, losses


def test_an_undeclared_attribute_use_is_declared_at_its_first_use():
    """As DeepSpeed gathers a parameter it finds not available on access:
    the head's weight is gathered for the model from its first use on, on
    every rank, and training matches torch."""
    results = run_ranks(undeclared_use, 2, timeout=300)
    torch.manual_seed(0)
    reference = SiblingWeight()
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.0)  # zcore's default
    x = torch.randn(4, 16)
    expected = []
    for _ in range(3):
        loss = reference(x).square().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)  # the config's default clipping
        opt.step()
        opt.zero_grad()
        expected.append(loss.item())
    for declared, recordings, losses in results:
        assert len(declared) == 1, declared  # once, on the first step
        assert "the model (SiblingWeight)" in declared[0] and "'head.weight'" in declared[0], declared
        assert recordings <= 2
        assert losses == pytest.approx(expected, rel=1e-5)
