"""Process-group set-up and the few collectives zcore issues.

zcore has no launcher of its own: under torchrun (env://) it joins the group
torchrun describes; with no launcher it runs as a world of one. Collectives
go through the names the installed torch offers (``all_gather_single`` and
``reduce_scatter_single`` on recent torch, the ``*_tensor`` names before).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from zcore import errors, tracing
from zcore.comm import counting_group, waits
from zcore.tracing import Wait

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_issued = 0  # collectives this process has started through this module (under _issuing)
_issuing = threading.Lock()  # collectives start on the training thread, autograd's and the step's


def issued() -> int:
    """How many collectives this process has started here: ranks in step
    have started as many (zcore.engine.rank_calls compares them)."""
    return _issued


@dataclass(frozen=True)
class DistributedContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def init_distributed(
    timeout: timedelta = timedelta(minutes=10), backend: Optional[str] = None, init_method: Optional[str] = None,
    rank: Optional[int] = None, world_size: Optional[int] = None,
) -> DistributedContext:
    """Joins (or creates) the default process group and picks this rank's
    device. ``backend``: default NCCL where torch sees a GPU, else gloo;
    ``init_method``: default env:// (the launcher's variables); ``rank``
    and ``world_size``: given, in place of the launcher's."""
    if not dist.is_initialized():
        launched = all(v in os.environ for v in _LAUNCHER_VARS)
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if rank is not None:
            dist.init_process_group(backend=backend, init_method=init_method or "env://", rank=rank,
                                    world_size=world_size, timeout=timeout)
        elif launched or init_method is not None:
            dist.init_process_group(backend=backend, init_method=init_method or "env://", timeout=timeout)
        else:
            # No launcher: a world of one, with an in-memory store.
            dist.init_process_group(
                backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return DistributedContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=device,
        backend=dist.get_backend(),
    )


def on_gloo() -> bool:
    """gloo takes the paths below that suit it; so does the backend that
    counts what gloo sends (zcore.comm.counting_group), or it would count others."""
    return dist.get_backend() in ("gloo", counting_group.BACKEND)


def _all_gather_by_send_recv(
    output: torch.Tensor, shard: torch.Tensor, group: Optional[dist.ProcessGroup]
) -> list[dist.Work]:
    """gloo's all-gather is slow: on 2 ranks, 10.6 ms for a 16 MiB output and
    62 ms for 64 MiB, against 6.2 and 23 ms when each rank sends its shard to
    every other rank and receives theirs (measured). So on gloo the shards
    are exchanged point to point, received straight into their slices of the
    output. Every rank gathers the same groups in the same order, so the
    k-th message between two ranks always belongs to the k-th gather.
    ``group``: a subgroup's ranks, in its own rank order (None: the world).
    Returns the sends and receives to wait for."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    slices = output.view(size, -1)
    slices[rank].copy_(shard)
    ops = []
    for i in range(size):
        if i != rank:
            peer = i if group is None else dist.get_global_rank(group, i)  # P2POp takes global ranks
            ops.append(dist.P2POp(dist.isend, shard, peer, group))
            ops.append(dist.P2POp(dist.irecv, slices[i], peer, group))
    # A group of one (a node of one rank in a two-level gather) has no peer.
    return dist.batch_isend_irecv(ops) if ops else []


class _Collective:
    """A collective in flight: ``wait()`` waits for its work (a timed comm
    wait, in slices where an engine watches: zcore.comm.waits), then runs
    ``finish``. Like torch's Work.wait(), a second call returns at once."""

    def __init__(self, works: list, kind: str, finish: Optional[Any] = None) -> None:
        global _issued
        with _issuing:
            _issued += 1
            self.seq = _issued
        self._works: Optional[list] = works
        self._kind = kind
        self._finish = finish

    def wait(self) -> None:
        if self._works is None:
            return
        with tracing.waiting(Wait.COMM):
            waits.wait_all(self._works, self.seq, self._kind)
        self._works = None
        if self._finish is not None:
            self._finish()
            self._finish = None


def all_gather_into(
    output: torch.Tensor, shard: torch.Tensor, async_op: bool = False, group: Optional[dist.ProcessGroup] = None
):
    """``output`` (ranks x shard elements) receives every rank's ``shard`` in
    rank order, over ``group`` (None: the world). ``shard`` must stay
    unchanged until the gather is waited for."""
    with tracing.span("all_gather"):
        if not on_gloo():
            work = _Collective([_all_gather(output, shard, group=group, async_op=True)], "all-gather")
        else:
            work = _Collective(_all_gather_by_send_recv(output, shard, group), "all-gather")
    if async_op:
        return work
    work.wait()
    return None


def _reduce_scatter_by_all_to_all(
    shard: torch.Tensor, full: torch.Tensor, group: Optional[dist.ProcessGroup]
) -> _Collective:
    """gloo's reduce-scatter runs slower than its all-reduce of the same
    buffer, and an all-reduce moves twice the bytes a reduce-scatter needs.
    So on gloo every rank sends each other rank that rank's slice (one
    all-to-all) and sums the slices it receives. Measured on 2 ranks, 16 MiB:
    7.4 ms against 12.5 ms (all-reduce) and 17.0 ms (reduce_scatter_tensor)."""
    received = torch.empty_like(full)  # slice ``rank`` of every rank's ``full``
    work = dist.all_to_all_single(received, full, group=group, async_op=True)

    def finish() -> None:
        torch.sum(received.view(-1, shard.numel()), dim=0, out=shard)

    return _Collective([work], "reduce-scatter", finish)


def reduce_scatter_sum(shard: torch.Tensor, full: torch.Tensor, group: Optional[dist.ProcessGroup] = None):
    """Starts summing ``full`` over the ranks of ``group`` (None: the world)
    into this rank's ``shard`` (slice ``rank`` of ``full``); returns a
    handle whose ``wait()`` completes it. ``full`` may be overwritten."""
    with tracing.span("reduce_scatter"):
        if on_gloo():
            return _reduce_scatter_by_all_to_all(shard, full, group)
        return _Collective(
            [_reduce_scatter(shard, full, op=dist.ReduceOp.SUM, group=group, async_op=True)], "reduce-scatter"
        )


def all_to_all(
    output: torch.Tensor, input: torch.Tensor, async_op: bool = False, group: Optional[dist.ProcessGroup] = None
):
    """Slice r of ``input`` goes to rank r of ``group`` (None: the world);
    ``output``'s slice r comes from rank r (equal slices, flat)."""
    with tracing.span("all_to_all"):
        work = _Collective([dist.all_to_all_single(output, input, group=group, async_op=True)], "all-to-all")
    if async_op:
        return work
    work.wait()
    return None


def all_to_all_uneven(
    output: torch.Tensor, input: torch.Tensor, output_splits: list[int], input_splits: list[int],
    group: Optional[dist.ProcessGroup] = None,
) -> None:
    """``input_splits[r]`` elements of ``input`` go to rank r of ``group``
    (None: the world), in rank order; ``output`` receives
    ``output_splits[r]`` elements from rank r, in rank order (flat)."""
    with tracing.span("all_to_all"):
        _Collective(
            [dist.all_to_all_single(output, input, output_splits, input_splits, group=group, async_op=True)],
            "all-to-all",
        ).wait()


def all_reduce_sum(tensor: torch.Tensor, async_op: bool = False, group: Optional[dist.ProcessGroup] = None):
    with tracing.span("all_reduce"):
        work = _Collective([dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)], "all-reduce")
    if async_op:
        return work
    work.wait()
    return None


def all_reduce_max(tensor: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> None:
    """A check's small all-reduce (zcore.zero3.recording_checks): its wait is
    timed, as every collective's, but it is not one of the ``all_reduce``
    ranges of the step's own work."""
    _Collective([dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group, async_op=True)], "all-reduce").wait()


def all_gather_objects(obj: Any, group: Optional[dist.ProcessGroup] = None) -> list[Any]:
    """Every rank's ``obj`` (picklable) over ``group`` (None: the world), in
    rank order. For error paths: slow."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_from_rank0(tensors: list[torch.Tensor], group: Optional[dist.ProcessGroup] = None) -> None:
    """``tensors`` from the first rank of ``group`` (None: the world)."""
    for t in tensors:
        broadcast_from(t, 0, group)


def broadcast_from(tensor: torch.Tensor, position: int, group: Optional[dist.ProcessGroup] = None) -> None:
    """``tensor`` from the rank at ``position`` in ``group`` (None: the
    world); torch before 2.6 takes a global source rank only."""
    src = position if group is None else dist.get_global_rank(group, position)
    _Collective([dist.broadcast(tensor, src=src, group=group, async_op=True)], "broadcast").wait()


def wait_all(works: list[Optional[dist.Work]]) -> None:
    for work in works:
        if work is not None:
            work.wait()


def all_gather_strings(value: Optional[str], group: Optional[dist.ProcessGroup] = None) -> list[Optional[str]]:
    """Every rank's ``value`` (a short string or None), in rank order, over
    ``group`` (None: the world; another group must span the world too)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    out: list[Optional[str]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def raise_if_any_failed(
    error: Optional[BaseException], doing: str, error_type: type[Exception] = RuntimeError,
    group: Optional[dist.ProcessGroup] = None,
) -> None:
    """A collective over ``group`` (as ``all_gather_strings``): raises
    ``error`` on the rank that had it and, on every other rank, an error
    naming the rank that failed, so that no rank goes on (or waits forever)
    while another gave up."""
    messages = all_gather_strings(None if error is None else f"{type(error).__name__}\n{error}", group)
    if error is not None:
        raise error
    failed = [(rank, m) for rank, m in enumerate(messages) if m is not None]
    if failed:
        rank, message = failed[0]
        name, text = message.split("\n", 1)
        # The same zcore error class on every rank, so callers can catch it alike.
        same = getattr(errors, name, None)
        kind = same if isinstance(same, type) and issubclass(same, errors.ZcoreError) else error_type
        raise kind(f"{doing} failed on rank {rank}: {text}")
