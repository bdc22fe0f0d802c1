"""A torch.distributed backend that counts the bytes each rank sends.

For tests and benchmarks: bytes per step are counted on the process group,
not estimated from sizes. ``init_process_group()`` joins the default group
on backend ``"zcore_counting"`` (``BACKEND``); ``dist.new_group(ranks,
backend=BACKEND)`` makes subgroups, each with counters of its own.
zcore.comm.collectives takes gloo's paths on it, so what it counts is what zcore sends
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

Every kind also counts its calls, and every byte counts toward the peer
it is for (by global rank), so that traffic between nodes can be told from
traffic within one (``peer_bytes``): ``send`` to its destination, an
all-gather's or broadcast's B to every other rank, an all-to-all's slices
to their ranks, a reduce-scatter's B/n and an all-reduce's 2B/n to every
other rank, a gather's B to the destination. Operations not listed have no
backend on this group and fail when called, rather than go uncounted.
"""

from __future__ import annotations

import weakref
from collections import Counter
from datetime import timedelta
from fractions import Fraction
from typing import Optional

import torch
import torch.distributed as dist

BACKEND = "zcore_counting"
_GROUPS: weakref.WeakSet = weakref.WeakSet()  # every counting group of this process


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class CountingProcessGroup(dist.ProcessGroup):
    """gloo, counting what this rank sends (see the module docstring)."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        self.sent: Counter = Counter()  # kind -> bytes (Fraction)
        self.calls: Counter = Counter()  # kind -> operations
        self.to_peer: Counter = Counter()  # global rank -> bytes (Fraction)
        self._global_ranks: Optional[list[int]] = None
        _GROUPS.add(self)

    def _count(self, kind: str, per_peer: dict[int, Fraction | int]) -> None:
        """``per_peer``: bytes for each other rank of the group, by group rank."""
        self.sent[kind] += sum((Fraction(b) for b in per_peer.values()), Fraction(0))
        self.calls[kind] += 1
        if self._global_ranks is None:  # known once torch has registered the group
            self._global_ranks = [dist.get_global_rank(self, r) for r in range(self.size())]
        for peer, b in per_peer.items():
            self.to_peer[self._global_ranks[peer]] += Fraction(b)

    def _to_others(self, nbytes: Fraction | int) -> dict[int, Fraction | int]:
        return {r: nbytes for r in range(self.size()) if r != self.rank()}

    def reset(self) -> None:
        self.sent.clear()
        self.calls.clear()
        self.to_peer.clear()

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
        self._count("send", {dst: _nbytes(tensors)})
        return self._gloo.send(tensors, dst, tag)

    def recv(self, tensors, src, tag):
        self._count("recv", {})
        return self._gloo.recv(tensors, src, tag)

    def recv_anysource(self, tensors, tag):
        self._count("recv", {})
        return self._gloo.recv_anysource(tensors, tag)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts):
        n = self.size()
        if input_split_sizes:
            row = input[0].numel() * input.element_size()
            slices = [split * row for split in input_split_sizes]
        else:
            slices = [_nbytes([input]) // n] * n
        self._count("all_to_all", {r: slices[r] for r in range(n) if r != self.rank()})
        return self._gloo.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    def allgather(self, output_tensors, input_tensors, opts):
        self._count("all_gather", self._to_others(_nbytes(input_tensors)))
        return self._gloo.allgather(output_tensors, input_tensors, opts)

    def all_gather_single(self, output, input, opts):
        self._count("all_gather", self._to_others(_nbytes([input])))
        return self._gloo._allgather_base(output, input, opts)

    def reduce_scatter_single(self, output, input, opts):
        self._count("reduce_scatter", self._to_others(Fraction(_nbytes([input]), self.size())))
        return self._gloo._reduce_scatter_base(output, input, opts)

    def allreduce(self, tensors, opts):
        self._count("all_reduce", self._to_others(Fraction(2 * _nbytes(tensors), self.size())))
        return self._gloo.allreduce(tensors, opts)

    def broadcast(self, tensors, opts):
        root = self.rank() == opts.rootRank
        self._count("broadcast", self._to_others(_nbytes(tensors)) if root else {})
        return self._gloo.broadcast(tensors, opts)

    def gather(self, output_tensors, input_tensors, opts):
        self._count("gather", {} if self.rank() == opts.rootRank else {opts.rootRank: _nbytes(input_tensors)})
        return self._gloo.gather(output_tensors, input_tensors, opts)

    # The names torch before 2.13 calls for the same three operations.
    alltoall_base = all_to_all_single
    _allgather_base = all_gather_single
    _reduce_scatter_base = reduce_scatter_single

    def barrier(self, opts):
        self._count("barrier", {})
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
            "(zcore.comm.counting_group.init_process_group, or dist.new_group(..., backend=BACKEND))"
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


def peer_bytes(group: Optional[dist.ProcessGroup] = None) -> dict[int, Fraction]:
    """Bytes this rank sent on ``group`` to each other rank (by global
    rank) since it was made or last reset."""
    return dict(_counting(group).to_peer)


def peer_bytes_on_every_group() -> dict[int, Fraction]:
    """``peer_bytes`` summed over every counting group of this process."""
    total: Counter = Counter()
    for pg in list(_GROUPS):
        total.update(pg.to_peer)
    return dict(total)


def reset_all() -> None:
    """Resets every counting group of this process."""
    for pg in list(_GROUPS):
        pg.reset()
