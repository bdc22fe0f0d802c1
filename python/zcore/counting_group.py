"""A torch.distributed backend that counts the bytes each rank sends.

For tests and benchmarks: bytes per step are counted on the process group,
not estimated from sizes. ``init_process_group()`` joins the default group
on backend ``"zcore_counting"`` (``BACKEND``); ``dist.new_group(ranks,
backend=BACKEND)`` makes subgroups, each with counters of its own.
zcore.comm takes gloo's paths on it, so what it counts is what zcore sends
on gloo. Every operation runs on a real gloo backend built from the same
store, rank, size and timeout; the wrapper counts it, then delegates.

What is counted, per rank and per kind of operation: the payload bytes this
rank must deliver to other ranks, by the operation's definition, whatever
algorithm gloo runs underneath. With n ranks in the group and B the bytes
of this rank's tensor(s):

- ``send``: B (``isend`` and ``batch_isend_irecv`` too); ``recv``: 0;
- ``all_to_all`` (``all_to_all_single``): B minus this rank's own slice;
- ``all_gather`` (list or ``all_gather_single``): B x (n - 1), this rank's
  input to every other rank (a ring forwards others' inputs instead, the
  same count); object collectives reach the group as all-gathers of a size
  and a byte tensor, so ``all_gather_object`` counts here;
- ``reduce_scatter`` (``reduce_scatter_single``): B x (n - 1) / n, every
  slice but its own;
- ``all_reduce``: 2 x (n - 1) / n x B, a ring's reduce-scatter then
  all-gather; not a whole number of bytes in general, which is why counts
  are exact ``Fraction``s;
- ``broadcast``: B x (n - 1) on the root, 0 elsewhere;
- ``gather``: B on every rank but the destination, 0 there;
- ``barrier``: 0.

Every kind also counts its calls. Operations not listed have no backend on
this group and fail when called, rather than go uncounted.
"""

from __future__ import annotations

from collections import Counter
from datetime import timedelta
from fractions import Fraction
from typing import Optional

import torch
import torch.distributed as dist

BACKEND = "zcore_counting"


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class CountingProcessGroup(dist.ProcessGroup):
    """gloo, counting what this rank sends (see the module docstring)."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        self.sent: Counter = Counter()  # kind -> bytes (Fraction)
        self.calls: Counter = Counter()  # kind -> operations

    def _count(self, kind: str, sent: Fraction | int) -> None:
        self.sent[kind] += Fraction(sent)
        self.calls[kind] += 1

    def reset(self) -> None:
        self.sent.clear()
        self.calls.clear()

    def getBackendName(self) -> str:  # the name torch's logs and errors give the backend
        return BACKEND

    # torch names each group after making it; a Python group keeps the name
    # itself (a DeviceMesh finds its groups by name).
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return self._group_name

    def send(self, tensors, dst, tag):
        self._count("send", _nbytes(tensors))
        return self._gloo.send(tensors, dst, tag)

    def recv(self, tensors, src, tag):
        self._count("recv", 0)
        return self._gloo.recv(tensors, src, tag)

    def recv_anysource(self, tensors, tag):
        self._count("recv", 0)
        return self._gloo.recv_anysource(tensors, tag)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts):
        if input_split_sizes:
            own = input_split_sizes[self.rank()] * (input[0].numel() * input.element_size())
        else:
            own = _nbytes([input]) // self.size()
        self._count("all_to_all", _nbytes([input]) - own)
        return self._gloo.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    def allgather(self, output_tensors, input_tensors, opts):
        self._count("all_gather", _nbytes(input_tensors) * (self.size() - 1))
        return self._gloo.allgather(output_tensors, input_tensors, opts)

    def all_gather_single(self, output, input, opts):
        self._count("all_gather", _nbytes([input]) * (self.size() - 1))
        return self._gloo._allgather_base(output, input, opts)

    def reduce_scatter_single(self, output, input, opts):
        self._count("reduce_scatter", Fraction(_nbytes([input]) * (self.size() - 1), self.size()))
        return self._gloo._reduce_scatter_base(output, input, opts)

    def allreduce(self, tensors, opts):
        n = self.size()
        self._count("all_reduce", Fraction(2 * (n - 1) * _nbytes(tensors), n))
        return self._gloo.allreduce(tensors, opts)

    def broadcast(self, tensors, opts):
        root = self.rank() == opts.rootRank
        self._count("broadcast", _nbytes(tensors) * (self.size() - 1) if root else 0)
        return self._gloo.broadcast(tensors, opts)

    def gather(self, output_tensors, input_tensors, opts):
        self._count("gather", 0 if self.rank() == opts.rootRank else _nbytes(input_tensors))
        return self._gloo.gather(output_tensors, input_tensors, opts)

    def barrier(self, opts):
        self._count("barrier", 0)
        return self._gloo.barrier(opts)

    def shutdown(self) -> None:
        self._gloo.shutdown()


def register() -> None:
    """Makes ``BACKEND`` known to torch.distributed (once per process)."""
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, CountingProcessGroup, devices=["cpu"])


def init_process_group(timeout: timedelta = timedelta(minutes=10)) -> None:
    """Joins the default group that torchrun's environment describes
    (env://) on the counting backend; zcore.initialize then joins it."""
    register()
    dist.init_process_group(backend=BACKEND, init_method="env://", timeout=timeout)


def _counting(group: Optional[dist.ProcessGroup]) -> CountingProcessGroup:
    pg = group if group is not None else dist.group.WORLD
    if not isinstance(pg, CountingProcessGroup):
        raise ValueError(
            f"process group {pg!r} does not count bytes: create it with backend={BACKEND!r} "
            "(zcore.counting_group.init_process_group, or dist.new_group(..., backend=BACKEND))"
        )
    return pg


def counters(group: Optional[dist.ProcessGroup] = None) -> dict[str, Fraction]:
    """Bytes this rank sent on ``group`` (default: the default group) since
    it was made or last reset, by kind."""
    return dict(_counting(group).sent)


def calls(group: Optional[dist.ProcessGroup] = None) -> dict[str, int]:
    """Operations this rank issued on ``group``, by kind."""
    return dict(_counting(group).calls)


def reset(group: Optional[dist.ProcessGroup] = None) -> None:
    _counting(group).reset()
