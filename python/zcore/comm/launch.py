"""``zcore.init_distributed``: DeepSpeed's ``deepspeed.init_distributed``,
for scripts that join the process group before ``initialize``.

zcore has no launcher of its own: ranks come from the environment torchrun
and DeepSpeed's launcher set (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT),
or from ``rank``, ``world_size`` and ``init_method`` given here; with
neither, the process is a world of one. DeepSpeed's discovery of ranks
under mpirun (mpi4py) is not zcore's: such a run is refused with the
launcher to use instead.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from zcore.comm import collectives
from zcore.errors import InvalidArgumentError, InvalidStateError

log = logging.getLogger("zcore")

_BACKENDS = ("nccl", "gloo")
# What mpirun (Open MPI, MPICH) sets in place of a launcher's RANK.
_MPI_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK")


def init_distributed(
    dist_backend: Optional[str] = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: timedelta = dist.default_pg_timeout,
    init_method: Optional[str] = None,
    dist_init_required: Optional[bool] = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Joins the default process group, or creates it, as
    ``deepspeed.init_distributed`` does; a process whose group exists
    already keeps it. ``dist_backend``: "nccl" or "gloo" (None: NCCL where
    torch sees a GPU, gloo otherwise). ``rank``, ``world_size`` and
    ``init_method`` (a URL such as ``tcp://host:port``) describe the group
    without a launcher; ``distributed_port`` is the MASTER_PORT a launcher
    that sets none of its own gets. ``dist_init_required=False`` requires
    the group to exist. ``auto_mpi_discovery``, ``verbose`` and ``config``
    are DeepSpeed's: an mpirun launch is refused (use torchrun or the
    deepspeed launcher), ``verbose`` logs the group joined, ``config`` is
    not read here (zcore.initialize reads it)."""
    if dist_backend is not None and dist_backend not in _BACKENDS:
        raise InvalidArgumentError(
            f"init_distributed(dist_backend={dist_backend!r}): zcore runs on {' or '.join(_BACKENDS)}",
            argument="dist_backend",
        )
    if dist.is_initialized():
        if dist_backend is not None and dist.get_backend() != dist_backend:
            raise InvalidStateError(
                f"init_distributed(dist_backend={dist_backend!r}): this process's process group exists "
                f"already, on {dist.get_backend()}; ask for that backend, or call init_distributed before "
                "anything creates the group"
            )
        return
    if dist_init_required is False:
        raise InvalidStateError(
            "init_distributed(dist_init_required=False) needs a process group initialized already "
            "(torch.distributed.init_process_group)"
        )
    if dist_backend == "nccl" and not torch.cuda.is_available():
        raise InvalidArgumentError(
            "init_distributed(dist_backend='nccl') on a machine where torch sees no GPU: use 'gloo'",
            argument="dist_backend",
        )
    if auto_mpi_discovery and "RANK" not in os.environ and any(v in os.environ for v in _MPI_VARS):
        raise InvalidStateError(
            "init_distributed: this process was started by mpirun, whose ranks zcore does not discover; "
            "launch with torchrun (or the deepspeed launcher), which set RANK, WORLD_SIZE, MASTER_ADDR "
            "and MASTER_PORT"
        )
    if (rank >= 0) != (world_size > 0):
        raise InvalidArgumentError(
            f"init_distributed(rank={rank}, world_size={world_size}): give both, or neither (the launcher's "
            "environment then gives them)",
            argument="rank",
        )
    named = rank >= 0
    if init_method in (None, "env://") and (named or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)):
        # env:// with the ranks known: the rendezvous a launcher would name.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    collectives.init_distributed(timeout, backend=dist_backend, init_method=init_method,
                                 rank=rank if named else None, world_size=world_size if named else None)
    if verbose:
        log.info("zcore: joined the process group on %s: rank %d of %d", dist.get_backend(), dist.get_rank(),
                 dist.get_world_size())
