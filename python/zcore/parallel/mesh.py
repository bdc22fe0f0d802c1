"""zcore inside a torch ``DeviceMesh`` of several kinds of parallelism.

A mesh whose ``mesh_dim_names`` hold ``"dp"`` says that zcore shards over
that dimension only; the others stay torch's: ``"tp"``, tensor parallelism
with DTensor and ``parallelize_module``; ``"pp"``, pipeline parallelism with
``torch.distributed.pipelining``, each rank holding one stage
(zcore.parallel.pipelining). Each rank's data-parallel group
is the ranks that differ from it in ``dp`` alone: they hold the same
tensor-parallel slices of the same parameters, so ZeRO's reduce-scatters,
all-gathers and broadcasts run on it exactly as on the world without a mesh.

A DTensor parameter is a wrapper whose values live in its local tensor
(this rank's slice): zcore's flat buffers hold local tensors, and the
parameter is re-pointed by replacing that local tensor (torch has no public
setter; ``.data`` on a DTensor would drop its sharding).

Clipping takes the norm over both dimensions. A parameter sharded over tp
(a ``Shard`` placement) has disjoint slices on the tp ranks, which sum;
every other parameter (plain, or a replicated DTensor) is the same on every
tp rank and must count once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from zcore.comm.collectives import raise_if_any_failed
from zcore.config.schema import Config
from zcore.parallel.dtensor import dtensor_module, is_dtensor, tp_sharded
from zcore.errors import ConfigError
from zcore.comm.topology import RankGroup, Topology

DATA_PARALLEL, TENSOR_PARALLEL, PIPELINE_PARALLEL = "dp", "tp", "pp"
KNOWN_DIMENSIONS = (DATA_PARALLEL, TENSOR_PARALLEL, PIPELINE_PARALLEL)


@dataclass(frozen=True)
class ModelParallelMesh:
    """The user's mesh, this rank's data-parallel group over ``dp`` and the
    size of the tensor-parallel dimension (1 without one)."""

    mesh: DeviceMesh
    data_parallel: RankGroup
    tp_size: int
    tp_rank: int

    @property
    def pipelined(self) -> bool:
        return PIPELINE_PARALLEL in self.mesh.mesh_dim_names


def model_parallel_mesh(mesh: Optional[DeviceMesh]) -> Optional[ModelParallelMesh]:
    """The mesh's parallelism when it names a ``"dp"`` dimension; None for
    no mesh or a mesh of nodes (zcore.comm.topology)."""
    names = getattr(mesh, "mesh_dim_names", None) or ()
    if mesh is None or DATA_PARALLEL not in names:
        return None
    unknown = [n for n in names if n not in KNOWN_DIMENSIONS]
    if unknown or len(set(names)) != len(names):
        raise ConfigError(
            f"device_mesh has dimensions {names}; zcore shards over \"dp\" and composes with torch's "
            f"tensor parallelism over \"tp\" and pipeline parallelism over \"pp\": name the dimensions "
            f"from {KNOWN_DIMENSIONS}, each once"
        )
    if mesh.size() != dist.get_world_size():
        raise ConfigError(
            f"device_mesh holds {mesh.size()} ranks but the world has {dist.get_world_size()}: pass a mesh "
            "of every rank"
        )
    dp = mesh[DATA_PARALLEL]
    return ModelParallelMesh(
        mesh=mesh,
        data_parallel=RankGroup(dp.get_group(), dp.size(), dp.get_local_rank()),
        tp_size=mesh[TENSOR_PARALLEL].size() if TENSOR_PARALLEL in names else 1,
        tp_rank=mesh[TENSOR_PARALLEL].get_local_rank() if TENSOR_PARALLEL in names else 0,
    )


def check_parameters(model: torch.nn.Module, mesh: ModelParallelMesh) -> None:
    """Every DTensor parameter lives on the mesh's "tp" dimension, sharded
    along one dimension or replicated: what zcore can shard over "dp"."""
    tp = mesh.mesh[TENSOR_PARALLEL] if TENSOR_PARALLEL in mesh.mesh.mesh_dim_names else None
    if any(p.is_meta for p in model.parameters()):
        raise ConfigError(
            "the model is on the meta device; with a device_mesh zcore does not materialise it yet: "
            "build it on a real device (or materialise it) before parallelize_module and zcore.initialize"
        )
    for name, p in model.named_parameters():
        if not is_dtensor(p):
            continue
        placements, module = p.placements, dtensor_module()
        on_tp = tp is not None and p.device_mesh.ndim == 1 and p.device_mesh.mesh.tolist() == tp.mesh.tolist()
        if not on_tp or not all(isinstance(pl, (module.Shard, module.Replicate)) for pl in placements):
            raise ConfigError(
                f"parameter {name} is a DTensor on a mesh of ranks {p.device_mesh.mesh.tolist()} placed "
                f"{placements}; zcore shards over \"dp\" the parameters that torch's tensor parallelism "
                "places on the \"tp\" dimension (Shard or Replicate): parallelize the model over "
                "device_mesh[\"tp\"] only"
            )


def replicated_pieces(units: list) -> list[tuple[int, int, int]]:
    """``(unit, first element in the shard, elements)`` of every piece of a
    parameter that every tensor-parallel rank holds whole (zcore.step.units)."""
    return [
        (u, piece.shard_start, piece.numel)
        for u, unit in enumerate(units)
        for piece in unit.pieces
        if not tp_sharded(unit.params[piece.param_index])
    ]


def global_squared_norm(
    squares: torch.Tensor, replicated: torch.Tensor, sharded: bool, mesh: ModelParallelMesh
) -> torch.Tensor:
    """The squared gradient norm over every rank of the mesh, from this
    rank's ``squares`` (of its shards; ``sharded`` False: every data-parallel
    rank holds the whole gradient) of which ``replicated`` come from
    parameters every tp rank holds: those count once over the tp ranks, and
    whole gradients once over the dp ranks."""
    total = squares - replicated * (1.0 - 1.0 / mesh.tp_size)
    if not sharded:
        total = total / mesh.data_parallel.size
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total


def refuse_with_model_parallel(cfg: Config, mesh: ModelParallelMesh) -> None:
    """What zcore does not compose with a mesh of several parallelisms yet,
    refused by key before anything is built."""
    zero = cfg.zero_optimization
    optimizer = cfg.optimizer.type if cfg.optimizer is not None else None
    refused = [
        (zero.offload_optimizer.device == "nvme", "zero_optimization.offload_optimizer.device = 'nvme' (use 'cpu')"),
        (zero.offload_param.device == "nvme", "zero_optimization.offload_param.device = 'nvme' (use 'cpu')"),
        (zero.zero_quantized_weights, "zero_optimization.zero_quantized_weights"),
        (zero.zero_quantized_gradients, "zero_optimization.zero_quantized_gradients"),
        (zero.zero_hpz_partition_size > 1, "zero_optimization.zero_hpz_partition_size"),
        (zero.mics_shard_size > 0, "zero_optimization.mics_shard_size"),
        (optimizer in ("OneBitAdam", "ZeroOneAdam"), f"optimizer.type = {optimizer!r}"),
    ]
    named = [what for bad, what in refused if bad]
    if named:
        raise ConfigError(
            f"with a device_mesh of dimensions {mesh.mesh.mesh_dim_names}, zcore does not support "
            f"{', '.join(named)} yet; remove them, or pass no mesh"
        )


def refuse_stages_without_parameters(model: torch.nn.Module, mesh: ModelParallelMesh, trains: bool) -> None:
    """Collective over the pipeline's ranks (when ``trains`` and ``mesh``
    pipelines): a stage with nothing to train is refused on every rank, not
    on its own while the others wait."""
    if not (trains and mesh.pipelined):
        return
    problem = None
    if not any(p.requires_grad for p in model.parameters()):
        problem = ConfigError(
            "this pipeline stage has no parameter that requires grad; zcore trains every stage of a "
            "pipeline, so each needs one: move a layer with parameters into it, or join it to a neighbour"
        )
    raise_if_any_failed(problem, "zcore.initialize", ConfigError)


@dataclass(frozen=True)
class DataParallelRanks:
    """Stage 3 spreads each group's shards over ``shard`` (the data-parallel
    ranks, or a MiCS shard group) and, with MiCS, holds the same shard on
    every rank of ``replicas``; ``topology``: None where nothing needed
    one. ``model_parallel``: the mesh whose "dp" dimension the data-parallel
    ranks are (this module); None: they are the world."""

    shard: RankGroup
    replicas: Optional[RankGroup] = None
    topology: Optional[Topology] = None
    model_parallel: Optional[ModelParallelMesh] = None

    @property
    def data_parallel(self) -> RankGroup:
        """Every data-parallel rank: the world, or this rank's group over the mesh's "dp"."""
        return RankGroup.world() if self.model_parallel is None else self.model_parallel.data_parallel

    @property
    def device_mesh(self) -> Optional[DeviceMesh]:
        """The "dp" x "tp" mesh given, or the nodes x ranks mesh of the
        topology; None where no feature needed one."""
        if self.model_parallel is not None:
            return self.model_parallel.mesh
        return self.topology.mesh if self.topology is not None else None

    @property
    def writes_shards(self) -> bool:
        """This rank's copy of its shards is the one a checkpoint stores
        (the first shard group's)."""
        return self.replicas is None or self.replicas.rank == 0
