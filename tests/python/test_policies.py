"""zcore.config.policies: the config decoded once into what each stage shards and
where the optimizer's states live, against DeepSpeed's documented meaning of
each stage and offload setting."""

from __future__ import annotations

import pytest
import torch

from zcore.comm.collectives import DistributedContext
from zcore.config.schema import load_config
from zcore.config.policies import Tier, policies_from_config


def context(world_size: int = 4, rank: int = 2, device: str = "cpu") -> DistributedContext:
    return DistributedContext(rank, world_size, rank, torch.device(device), "gloo")


def decode(zero: dict, ctx: DistributedContext | None = None):
    cfg = load_config({"train_batch_size": 8, "zero_optimization": zero})
    return policies_from_config(cfg, ctx or context())


# stage: (optimizer states sharded, gradients reduce-scattered as they come, parameters sharded)
DEEPSPEED_STAGES = {0: (False, False, False), 1: (True, False, False), 2: (True, True, False), 3: (True, True, True)}


@pytest.mark.parametrize("stage", sorted(DEEPSPEED_STAGES))
def test_each_stage_shards_what_deepspeed_says(stage: int) -> None:
    p = decode({"stage": stage}).stage
    assert (p.shards_optimizer_states, p.reduce_scatters_every_micro_step, p.shards_parameters) == (
        DEEPSPEED_STAGES[stage]
    )
    assert p.unit_shards == ((1, 0) if stage == 0 else (4, 2))
    assert p.gathers_updated_units == (stage in (1, 2))


def test_one_rank_has_nothing_to_gather_after_a_step() -> None:
    assert not decode({"stage": 2}, context(world_size=1, rank=0)).stage.gathers_updated_units


def test_optimizer_offload_puts_the_master_on_the_host() -> None:
    on_host = decode({"stage": 2, "offload_optimizer": {"device": "cpu"}}).offload
    assert on_host.optimizer is Tier.HOST
    assert on_host.master_device(torch.device("cuda", 1)) == torch.device("cpu")
    on_device = decode({"stage": 2}).offload
    assert on_device.optimizer is Tier.DEVICE
    assert on_device.master_device(torch.device("cuda", 1)) == torch.device("cuda", 1)


def test_pinning_needs_host_states_and_cuda() -> None:
    pinned = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    assert decode(pinned, context(device="cuda")).offload.pin_memory
    assert not decode(pinned, context(device="cpu")).offload.pin_memory
    assert not decode({"stage": 2}, context(device="cuda")).offload.pin_memory
