"""The config decoded once into what it decides: what the ZeRO stage shards,
and where the optimizer's states live.

``zcore.initialize`` builds one ``Policies`` at the top and passes its parts
to whatever needs them; code below it asks a policy (``stage.shards_parameters``,
``offload.optimizer``), never the raw config's stage number or device string.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum
from typing import Optional

import torch

from zcore.comm.collectives import DistributedContext
from zcore.config.schema import Config
from zcore.errors import ConfigError, DiskIOError
from zcore.memory.swap import SwapManager
from zcore.comm.topology import RankGroup


class Tier(Enum):
    """Where a kind of state lives between uses (DeepSpeed's offload device names)."""

    DEVICE = "none"  # the compute device: a GPU, or the CPU when training on it
    HOST = "cpu"  # host memory
    NVME = "nvme"  # files on a local disk, read through host memory


@dataclass(frozen=True)
class SwapSpace:
    """A directory for swap files and how zcore's I/O engine uses it (the
    config's nvme_path and aio section)."""

    path: str
    key: str  # the config key that named the path, for errors
    block_size: int
    queue_depth: int
    threads: int

    def open(self, name: str, capacity: int, host_bytes: int) -> SwapManager:
        """This rank's swap file ``name`` of ``capacity`` bytes, reading
        through a host pool of ``host_bytes``; the directory is created
        first where it is missing."""
        self._make_directory()
        try:
            return SwapManager(
                self.path, capacity, name=name, host_budget=host_bytes,
                block_size=self.block_size, queue_depth=self.queue_depth, threads=self.threads,
            )
        except DiskIOError as exc:
            raise type(exc)(f"{self.key} = {self.path!r} cannot hold swap files: {exc}", **exc.details) from exc

    def _make_directory(self) -> None:
        """Creates the directory and its parents where missing, as DeepSpeed
        does (runtime/swap_tensor's swappers call os.makedirs(exist_ok=True)).
        Every rank does so, concurrently: a directory another rank has just
        created is no error."""
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as exc:
            # exc.filename: the component that failed, which may be a parent.
            where = exc.filename if isinstance(exc.filename, str) else self.path
            reason = f"{where!r}: {exc.strerror or exc}"
            in_the_way = _not_a_directory(self.path)
            if in_the_way is not None:
                reason += f" ({in_the_way!r} exists and is not a directory)"
            raise DiskIOError(
                f"{self.key} = {self.path!r} is not a directory and cannot be created: {reason}; set it to "
                "a directory on a local disk this process may write to, or create that directory first",
                path=self.path, errno=exc.errno,
            ) from exc
        except ValueError as exc:  # a NUL byte: no path the OS takes
            raise DiskIOError(
                f"{self.key} = {self.path!r} is not a usable path ({exc}); set it to a directory on a local disk",
                path=self.path,
            ) from exc


def _not_a_directory(path: str) -> Optional[str]:
    """The nearest of ``path`` and its parents that exists, where it is not
    a directory (what stops the path from being created); else None."""
    while not os.path.lexists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent
    return None if os.path.isdir(path) else path


@dataclass(frozen=True)
class StagePolicy:
    """What ZeRO stage ``stage`` shards over ``world_size`` data-parallel ranks."""

    stage: int
    world_size: int
    rank: int
    # Stage 3: the ranks each parameter group is sharded over, in blocks of
    # consecutive ranks that each hold the whole model (MiCS); the world
    # without MiCS.
    shard_size: int

    @property
    def replicates_shards(self) -> bool:
        """MiCS: several shard groups, each rank's shard held by one rank of each."""
        return self.shard_size < self.world_size

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
    parameter_swap: Optional[SwapSpace] = None  # parameters on NVMe
    optimizer_swap: Optional[SwapSpace] = None  # optimizer states on NVMe
    # Stage 3 offload: staging for shards read ahead of their all-gathers,
    # as the user set it: (offload_param.buffer_count, buffer_size), in
    # elements; None derives it from the model.
    staging_buffers: Optional[tuple[int, int]] = None
    # Parameters on NVMe: elements of this rank's shards kept in host memory
    # instead (offload_param.max_in_cpu).
    nvme_host_elements: int = 0
    sub_group_size: int = 1_000_000_000  # optimizer elements stepped (and swapped) at once
    sub_group_size_set: bool = False  # given in the config, rather than the default
    optimizer_buffers: int = 4  # host buffers of a sub-group each for the NVMe optimizer
    read_ahead: bool = True  # NVMe optimizer: read the next sub-group during a sub-group's step
    write_behind: bool = True  # NVMe optimizer: write a sub-group back during the next one's step

    def master_device(self, compute: torch.device) -> torch.device:
        """Where an in-memory optimizer keeps the master shards (not NVMe)."""
        return torch.device("cpu") if self.optimizer is Tier.HOST else compute


@dataclass(frozen=True)
class CommPolicy:
    """What crosses the wire quantized (ZeRO++: zcore.comm.quantized_collectives),
    and where stage 3's parameter all-gathers go (hpZ: zcore.zero3.secondary_partition)."""

    quantized_weights: bool = False  # stage 3's parameter all-gathers in int8
    quantized_gradients: bool = False  # the gradient reduce-scatters in int4
    # Ranks per hpZ block (contiguous global ranks, a node) within which a
    # group gathered once is gathered again from secondaries; 1: none.
    hpz_size: int = 1
    # MiCS: a shard group spanning nodes gathers across nodes, then within.
    hierarchical_gather: bool = False


@dataclass(frozen=True)
class Policies:
    stage: StagePolicy
    offload: OffloadPolicy
    comm: CommPolicy = CommPolicy()


def policies_from_config(
    cfg: Config, context: DistributedContext, data_parallel: Optional[RankGroup] = None
) -> Policies:
    """``data_parallel``: the ranks ZeRO shards over (default: the world)."""
    ranks = (context.world_size, context.rank) if data_parallel is None else (data_parallel.size, data_parallel.rank)
    world, rank = ranks
    zero = cfg.zero_optimization
    param, opt = zero.offload_param, zero.offload_optimizer
    optimizer = Tier(opt.device)
    parameters = Tier(param.device)
    # torch can pin host memory only where CUDA is available.
    cuda = context.device.type == "cuda"
    explicit = {"buffer_count", "buffer_size"} & param.model_fields_set
    return Policies(
        stage=StagePolicy(
            zero.stage, world, rank, _mics_size(zero.mics_shard_size, world)
        ),
        offload=OffloadPolicy(
            optimizer=optimizer,
            pin_memory=optimizer is not Tier.DEVICE and opt.pin_memory and cuda,
            parameters=parameters,
            pin_parameters=parameters is not Tier.DEVICE and param.pin_memory and cuda,
            parameter_swap=_swap_space(cfg, "offload_param") if parameters is Tier.NVME else None,
            optimizer_swap=_swap_space(cfg, "offload_optimizer") if optimizer is Tier.NVME else None,
            staging_buffers=(param.buffer_count, param.buffer_size) if explicit else None,
            nvme_host_elements=param.max_in_cpu if parameters is Tier.NVME else 0,
            sub_group_size=zero.sub_group_size,
            sub_group_size_set="sub_group_size" in zero.model_fields_set,
            optimizer_buffers=opt.buffer_count,
            read_ahead=opt.pipeline_read,
            write_behind=opt.pipeline_write,
        ),
        # Nothing crosses a wire in a world of one: nothing to quantize.
        comm=CommPolicy(
            quantized_weights=zero.zero_quantized_weights and world > 1,
            quantized_gradients=zero.zero_quantized_gradients and world > 1,
            hpz_size=_hpz_size(zero.zero_hpz_partition_size, world),
            hierarchical_gather=zero.mics_hierarchical_params_gather and world > 1,
        ),
    )


def _hpz_size(size: int, world: int) -> int:
    """A block of ``size`` ranks or more that holds every rank gathers over
    the world already, so a secondary would only cost memory: none then
    (DeepSpeed takes min(size, world) and keeps one that duplicates the
    primary). Blocks must tile the world."""
    if size <= 1 or size >= world:
        return 1
    if world % size:
        raise ConfigError(
            f"zero_optimization.zero_hpz_partition_size = {size} must divide the world size ({world}): hpZ "
            f"blocks are {size} consecutive ranks, one node each; set it to the ranks per node "
            f"(LOCAL_WORLD_SIZE), a divisor of {world}, or 1 to turn hpZ off"
        )
    return size


def _mics_size(size: int, world: int) -> int:
    """The ranks stage 3 shards over: MiCS's groups of ``size``, or the world."""
    if size == -1:
        return world
    if size > world or world % size:
        raise ConfigError(
            f"zero_optimization.mics_shard_size = {size} must divide the world size ({world}): MiCS shards "
            f"each copy of the model over {size} consecutive ranks and replicates it across the groups; "
            f"set it to a divisor of {world} (the ranks per node is the usual choice) or -1 to turn MiCS off"
        )
    return size


def _swap_space(cfg: Config, section: str) -> SwapSpace:
    path = getattr(cfg.zero_optimization, section).nvme_path
    assert path is not None  # the config requires nvme_path with device "nvme"
    # Resolved now: a relative path would follow the script into the next
    # os.chdir(), away from the swap files it holds.
    return SwapSpace(
        os.path.abspath(path), f"zero_optimization.{section}.nvme_path",
        cfg.aio.block_size, cfg.aio.queue_depth, cfg.aio.intra_op_parallelism,
    )
