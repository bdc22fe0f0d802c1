"""Memory per rank: optimizer states shard as 12 bytes x parameters / world
size (fp32 Adam: master, exp_avg, exp_avg_sq), stage 2 keeps no full-size
fp32 gradient, and stages 2-3 hold their gradient shards only from backward
to the step; with offload, each category is counted on the tier
the policy puts it on (device, host, NVMe), as the theory says."""

import pytest
import torch

import zcore
from distributed import run_ranks
from models import wide_mlp
from training import zcore_config


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
                # No full-size fp32 gradient, and between steps no shard either.
                assert report.measured.gradients == 0
            assert "optimizer_states" in str(report)


def gradients_through_a_step(rank, world, stage):
    """Device gradient bytes after a forward, after its backward and after
    the step, on the second step; and zcore's estimate's figures."""
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 50_000},
    }
    engine, _, _, _ = zcore.initialize(model=wide_mlp(), config=config)
    seen = []
    for step in range(2):
        x = torch.randn(4, 200, generator=torch.Generator().manual_seed(step * 10 + rank))
        y = engine(x)
        after_forward = engine.memory_report().measured_tiers["device"].gradients
        engine.backward(y.pow(2).mean())
        after_backward = engine.memory_report().measured_tiers["device"].gradients
        engine.step()
        seen.append((after_forward, after_backward, engine.memory_report().measured_tiers["device"].gradients))
    estimate = zcore.estimate_memory(wide_mlp(), config, world, device="cpu").tiers["device"]
    return seen[-1], (estimate.gradients, estimate.gradient_shards)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gradient_shards_live_from_backward_to_the_step_at_stages_2_and_3(stage):
    """As DeepSpeed frees its fp32 partition gradients after the step and
    FSDP2 its sharded ones at zero_grad: at stages 2-3 a forward runs with
    no gradient in memory, backward makes this rank's fp32 shard (4 bytes
    per element of it, padding aside), the step frees it; the estimate
    counts it as working memory. Stage 1 keeps its full-size accumulator
    and reduced shard throughout, as a model state."""
    world = 2
    params = sum(p.numel() for p in wide_mlp().parameters())
    for rank, ((forward, backward, stepped), (held, working)) in enumerate(
        run_ranks(gradients_through_a_step, world, stage, timeout=300)
    ):
        where = f"stage {stage}, rank {rank}"
        if stage == 1:
            assert forward == backward == stepped == held >= 4 * params + 4 * params // world, where
            assert working == 0, where
            continue
        assert forward == 0 and stepped == 0 and held == 0, where
        assert 4 * params // world <= backward <= 1.05 * 4 * params / world, where
        assert abs(working - backward) <= 0.05 * backward, where


def test_stage0_keeps_everything_on_every_rank():
    params = sum(p.numel() for p in wide_mlp().parameters())
    (report,) = run_ranks(train_and_report, 1, 0, launcher=False, timeout=120)
    assert report.measured.optimizer_states == 12 * params
    assert report.measured.parameters == 4 * params
    assert report.theoretical.optimizer_states == report.measured.optimizer_states


# Offload: each category on the tier the policy puts it on, measured within
# TOLERANCE of the theory (padding to the world size), plus, on NVMe, up to
# one I/O alignment of rounding per extent of the swap files.
TOLERANCE = 0.02
SWAP_ALIGNMENT = 4096
ON_DEMAND = {"stage3_param_persistence_threshold": 0}  # no group stays gathered


def offload_cases(nvme_path: str) -> dict[str, tuple[int, bool, dict]]:
    """label -> (stage, optimizer on the host, more zero_optimization keys)."""
    nvme = {"device": "nvme", "nvme_path": nvme_path}
    return {
        "optimizer on host": (2, True, {}),
        "parameters on host": (3, False, {**ON_DEMAND, "offload_param": {"device": "cpu"}}),
        "both on nvme": (3, False, {**ON_DEMAND, "offload_param": {**nvme, "max_in_cpu": 0},
                                    "offload_optimizer": nvme}),
        # The first groups' shards in host memory, up to max_in_cpu elements, the rest on NVMe.
        "parameters split by max_in_cpu": (3, True, {**ON_DEMAND, "offload_param": {**nvme, "max_in_cpu": 50_000}}),
    }


def train_offloaded(rank, world, label, nvme_path):
    stage, optimizer_on_host, zero = offload_cases(nvme_path)[label]
    config = zcore_config(stage, 1, 0.0, offload=optimizer_on_host, zero=zero)
    engine, _, _, _ = zcore.initialize(model=wide_mlp(), config=config)
    for step in range(3):
        x = torch.randn(8 // world, 200, generator=torch.Generator().manual_seed(step * 10 + rank))
        engine.backward(engine(x.to(engine.context.device)).pow(2).mean())
        engine.step()
    report = engine.memory_report()
    # Extents in the swap files: one per parameter group, one per sub-group.
    extents = len(engine.residency.groups) if stage == 3 else 0
    extents += len(getattr(engine.optimizer.master, "sub_groups", []))
    engine.destroy()
    return report, extents


def assert_tiers_match(report, extents: int, label: str) -> None:
    for tier in ("device", "host", "nvme"):
        slack = SWAP_ALIGNMENT * extents if tier == "nvme" else 0
        measured, theoretical = report.measured_tiers[tier], report.theoretical_tiers[tier]
        for category in ("parameters", "gradients", "optimizer_states", "buffers"):
            m, t = getattr(measured, category), getattr(theoretical, category)
            assert abs(m - t) <= TOLERANCE * t + slack, (
                f"{label}: {category} on {tier}: measured {m} bytes, theory {t}\n{report}"
            )


@pytest.mark.parametrize(
    "label", ["optimizer on host", "parameters on host", "both on nvme", "parameters split by max_in_cpu"]
)
def test_offloaded_bytes_are_on_their_tier(label, tmp_path):
    world = 2
    params = sum(p.numel() for p in wide_mlp().parameters())
    shard = 4 * params / world  # fp32 bytes of one rank's share
    for rank, (report, extents) in enumerate(run_ranks(train_offloaded, world, label, str(tmp_path), timeout=300)):
        where = f"{label}, rank {rank}"
        assert_tiers_match(report, extents, where)
        tiers = report.measured_tiers
        if label == "optimizer on host":
            assert tiers["device"].optimizer_states == 0, where
            assert tiers["host"].optimizer_states >= 3 * shard, where
            assert tiers["device"].parameters >= 4 * params, where  # stage 2: whole, on the device
        if label == "parameters on host":
            assert tiers["device"].parameters == 0, where
            assert tiers["host"].parameters >= shard, where
            assert tiers["device"].optimizer_states >= 3 * shard, where
        if label == "both on nvme":
            in_memory = tiers["device"].total + tiers["host"].total
            assert in_memory == tiers["device"].gradients, where  # the gradient shards (no module buffers)
            assert tiers["nvme"].parameters >= shard, where
            assert tiers["nvme"].optimizer_states >= 3 * shard, where
            assert "nvme" in str(report), where
        if label == "parameters split by max_in_cpu":
            # 50k elements hold the first Linear's shard (60.3k / 2), not the second's on top.
            first = 4 * (200 * 300 + 300) // world
            assert tiers["host"].parameters == first, where
            assert tiers["nvme"].parameters >= 4 * (300 * 300 + 300 + 300 * 10 + 10) // world, where
            assert tiers["device"].parameters == 0, where
