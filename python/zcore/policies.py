"""The config decoded once into what it decides: what the ZeRO stage shards,
and where the optimizer's states live.

``zcore.initialize`` builds one ``Policies`` at the top and passes its parts
to whatever needs them; code below it asks a policy (``stage.shards_parameters``,
``offload.optimizer``), never the raw config's stage number or device string.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from zcore.comm import DistributedContext
from zcore.config import Config


class Tier(Enum):
    """Where a kind of state lives between uses (DeepSpeed's offload device names)."""

    DEVICE = "none"  # the compute device: a GPU, or the CPU when training on it
    HOST = "cpu"  # host memory


@dataclass(frozen=True)
class StagePolicy:
    """What ZeRO stage ``stage`` shards over ``world_size`` data-parallel ranks."""

    stage: int
    world_size: int
    rank: int

    @property
    def shards_parameters(self) -> bool:
        """Stage 3: each rank keeps a shard of every parameter group, gathered on demand."""
        return self.stage == 3

    @property
    def shards_optimizer_states(self) -> bool:
        """Stages 1-3: each rank updates and keeps only its shard of the states."""
        return self.stage >= 1

    @property
    def reduce_scatters_every_micro_step(self) -> bool:
        """Stages 2-3: gradients are reduced to shards as they come (no full
        gradient kept); stages 0-1 accumulate whole gradients, then reduce."""
        return self.stage >= 2

    @property
    def unit_shards(self) -> tuple[int, int]:
        """Stages 0-2: (number of shards, this rank's shard) of each flat unit's
        optimizer state; stage 0 keeps it whole on every rank."""
        return (1, 0) if self.stage == 0 else (self.world_size, self.rank)

    @property
    def gathers_updated_units(self) -> bool:
        """Stages 1-2 over several ranks: after a step each rank's updated
        shard reaches the others by all-gather."""
        return 0 < self.stage < 3 and self.world_size > 1


@dataclass(frozen=True)
class OffloadPolicy:
    """Where the fp32 master shards and the optimizer's states live, and
    (stage 3) where each rank's parameter shards rest between uses."""

    optimizer: Tier
    pin_memory: bool  # optimizer's host buffers page-locked (only where CUDA is available)
    parameters: Tier = Tier.DEVICE
    pin_parameters: bool = False  # parameter shards on the host page-locked (CUDA only)

    def master_device(self, compute: torch.device) -> torch.device:
        return torch.device("cpu") if self.optimizer is Tier.HOST else compute


@dataclass(frozen=True)
class Policies:
    stage: StagePolicy
    offload: OffloadPolicy


def policies_from_config(cfg: Config, context: DistributedContext) -> Policies:
    zero = cfg.zero_optimization
    optimizer = Tier(zero.offload_optimizer.device)
    parameters = Tier(zero.offload_param.device)
    # torch can pin host memory only where CUDA is available.
    cuda = context.device.type == "cuda"
    return Policies(
        stage=StagePolicy(zero.stage, context.world_size, context.rank),
        offload=OffloadPolicy(
            optimizer=optimizer,
            pin_memory=optimizer is Tier.HOST and zero.offload_optimizer.pin_memory and cuda,
            parameters=parameters,
            pin_parameters=parameters is Tier.HOST and zero.offload_param.pin_memory and cuda,
        ),
    )
