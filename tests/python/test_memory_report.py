"""Memory per rank: optimizer states shard as 12 bytes x parameters / world
size (fp32 Adam: master, exp_avg, exp_avg_sq), and stage 2 keeps no
full-size fp32 gradient."""

import pytest
import torch
from torch import nn

import zcore
from distributed import run_ranks


def wide_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(200, 300), nn.ReLU(), nn.Linear(300, 300), nn.ReLU(), nn.Linear(300, 10))


def train_and_report(rank, world, stage):
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 50_000},
    }
    engine, _, _, _ = zcore.initialize(model=wide_mlp(), config=config)
    for step in range(3):
        x = torch.randn(4, 200, generator=torch.Generator().manual_seed(step * 10 + rank))
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    return engine.memory_report()


@pytest.mark.parametrize("world", [2, 4])
def test_optimizer_states_shard_by_world_size(world):
    params = sum(p.numel() for p in wide_mlp().parameters())
    for stage in (1, 2):
        reports = run_ranks(train_and_report, world, stage, timeout=300)
        for rank, report in enumerate(reports):
            expected = 12 * params / world
            measured = report.measured.optimizer_states
            assert abs(measured - expected) <= 0.05 * expected, (
                f"stage {stage} rank {rank}: {measured} bytes of optimizer state, expected {expected:.0f}"
            )
            assert report.trainable_parameters == params
            if stage == 2:
                # This rank's fp32 gradient shard only (padding aside).
                assert report.measured.gradients <= 1.05 * 4 * params / world
            assert "optimizer_states" in str(report)


def test_stage0_keeps_everything_on_every_rank():
    params = sum(p.numel() for p in wide_mlp().parameters())
    (report,) = run_ranks(train_and_report, 1, 0, launcher=False, timeout=120)
    assert report.measured.optimizer_states == 12 * params
    assert report.measured.parameters == 4 * params
    assert report.theoretical.optimizer_states == report.measured.optimizer_states
