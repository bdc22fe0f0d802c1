"""Gradient reduction across data-parallel ranks, overlapped with backward.

Autograd's post-accumulate-grad hook hands each parameter's gradient to the
reducer, which folds it into a unit buffer and frees ``param.grad``. A unit
whose gradients are all in is reduced at once, asynchronously, while
backward goes on. Units are launched in one fixed order on every rank (the
reverse of their layout, as backward produces them), so ranks whose control
flow differs still issue the same collectives in the same order; a unit
waiting for a gradient that never comes is launched at the end of backward.
Units whose gradients arrive at points that differ between ranks (a ZeRO-3
leaf module's, zcore.zero3.leaf_reductions) are held until a point every
rank shares releases them.

Two policies:
- ``AccumulateThenReduce`` (stages 0 and 1): gradients accumulate locally in
  a full-size fp32 buffer across micro-steps and are reduced once, during the
  backward of the boundary micro-step: all-reduce (stage 0, every rank keeps
  the whole unit) or reduce-scatter into this rank's shard (stage 1). At
  stage 0 an optimizer that averages over the ranks itself on some steps
  (zcore.optim.CompressedAdam: 1-bit Adam, 0/1 Adam) says which; on those
  the buffer keeps this rank's own gradient, averaged over micro-steps.
- ``ReduceScatterEveryMicroStep`` (stages 2 and 3): every micro-step's
  gradients are reduce-scattered and accumulated in fp32 into this rank's
  shard (zcore.step.gradient_shards: in memory, or on NVMe with the optimizer);
  no full-size fp32 gradient lives on a rank.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

import torch
import torch.distributed as dist

from zcore.comm import collectives as comm
from zcore.step.gradient_shards import GradientShards, ResidentGradients, squared_norm_of
from zcore.parallel.dtensor import local_grad
from zcore.step.units import Unit
from zcore.comm.topology import RankGroup

# Stage 2 keeps at most this many reduce-scatters in flight before retiring
# the oldest, which bounds the transient unit-sized buffers.
MAX_REDUCES_IN_FLIGHT = 2

ReduceScatter = Callable[[torch.Tensor, torch.Tensor], Any]


class GradientAveraging(Protocol):
    """An optimizer that averages over the ranks itself on some steps
    (zcore.optim.CompressedAdam)."""

    def takes_averaged_gradients(self) -> bool:
        """Whether the coming step expects gradients averaged over the ranks."""


class _UnitTracker:
    """Which parameters of each unit have delivered a gradient this micro-step,
    and the fixed launch order: the last unit first (backward's order)."""

    def __init__(self, units: list[Unit]) -> None:
        self.units = units
        self.missing = [len(u.params) for u in units]
        self.arrived = [[False] * len(u.params) for u in units]
        self.launches = 0  # units[-launches:] are launched
        self.held: set[int] = set()  # units that wait for release() every micro-step
        self.released: set[int] = set()  # of those, released this micro-step

    def arrive(self, unit: int, index: int) -> bool:
        """Records a gradient; True the first time this micro-step."""
        if self.arrived[unit][index]:
            return False
        self.arrived[unit][index] = True
        self.missing[unit] -= 1
        return True

    def launched(self, unit: int) -> bool:
        return unit >= len(self.units) - self.launches

    def release(self, units: list[int]) -> None:
        """Held ``units`` are complete: their parameters without a gradient
        yet contribute zeros."""
        for u in units:
            self.released.add(u)
            for i, arrived in enumerate(self.arrived[u]):
                if not arrived:
                    self.arrive(u, i)

    def launchable(self, flush: bool) -> list[int]:
        """Units to launch now, in order: complete ones, or all when flushing."""
        ready = []
        while self.launches < len(self.units):
            unit = len(self.units) - 1 - self.launches
            if not flush and (self.missing[unit] > 0 or (unit in self.held and unit not in self.released)):
                break
            ready.append(unit)
            self.launches += 1
        return ready

    def reset(self) -> None:
        self.missing = [len(u.params) for u in self.units]
        self.arrived = [[False] * len(u.params) for u in self.units]
        self.launches = 0
        self.released = set()


class GradientReducer:
    """Shared parts: hooks in, fp32 gradient shards and used-parameter flags out."""

    def __init__(
        self, units: list[Unit], world_size: int, reduce_dtype: torch.dtype, reduce_scatter: ReduceScatter,
        group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        """``reduce_scatter(shard, full)``: starts a bucket's reduce-scatter,
        returning what ``wait()`` completes (zcore.comm.quantized_collectives).
        ``group``: the ``world_size`` data-parallel ranks (None: the world)."""
        self.units = units
        self.world_size = world_size
        self.group = group
        self.reduce_dtype = reduce_dtype
        # A 16-bit sum over the ranks of loss-scaled gradients overflows where
        # their mean does not: such sums are of gradients already divided by
        # the world size, as DeepSpeed sends them. fp32 sums are divided after.
        self.predivide = reduce_dtype.itemsize < 4
        self.reduce_scatter = reduce_scatter
        self.tracker = _UnitTracker(units)
        self.boundary = True
        # Whether this window's gradients, at its boundary, are averaged over
        # the ranks (False: each rank's own, for an optimizer that averages itself).
        self.averaged = True
        # 1 where a parameter received a gradient on this rank in the current
        # accumulation window; all-reduced (max) at the boundary. Lists:
        # written once per gradient, made a tensor once per window.
        self.window_used = [[0] * len(u.params) for u in units]
        self._late_unit: int | None = None

    def begin_micro_step(self, boundary: bool) -> None:
        self.boundary = boundary

    def on_grad(self, unit: int, index: int, param: torch.nn.Parameter) -> None:
        grad = param.grad
        param.grad = None
        if grad is None:
            return
        grad = local_grad(param, grad)
        self.window_used[unit][index] = 1
        first = self.tracker.arrive(unit, index)
        if not first and self.tracker.launched(unit) and self._reduces_this_micro_step():
            self._late_unit = unit
        self._accumulate(unit, index, grad)
        if first:
            self._launch(self.tracker.launchable(flush=False))

    def hold(self, units: list[int]) -> None:
        """Every micro-step, ``units`` launch only once ``release``d (or at
        the end of backward): their gradients arrive at points that differ
        between ranks (zcore.zero3.leaf_reductions)."""
        self.tracker.held.update(units)

    def release(self, units: list[int]) -> None:
        """Held ``units`` are complete (their parameters without a gradient
        on this rank contribute zeros): they launch in the fixed order."""
        self.tracker.release(units)
        self._launch(self.tracker.launchable(flush=False))

    def end_backward(self) -> None:
        """Launches what is left, in order, and retires what must be done now."""
        if self._late_unit is not None:
            unit, self._late_unit = self._late_unit, None
            raise RuntimeError(
                f"a gradient for unit {unit} arrived after the unit was already reduced in this "
                "backward (a parameter's gradient was accumulated twice, e.g. by reentrant "
                "activation checkpointing: use torch.utils.checkpoint(..., use_reentrant=False); or it "
                "came after the backward of its ZeRO-3 leaf module was left: compute it from the "
                "leaf module's inputs)"
            )
        self._launch(self.tracker.launchable(flush=True))
        self._retire_all()
        self.tracker.reset()

    def used_params(self) -> list[torch.Tensor]:
        """Per unit, 1 where some rank's parameter got a gradient this window."""
        # On the units' device: an NCCL group has no CPU collectives.
        device = self.units[0].device if self.units else torch.device("cpu")
        flags = torch.tensor([f for unit in self.window_used for f in unit], dtype=torch.int32, device=device)
        if self.world_size > 1:
            comm.all_reduce_max(flags, group=self.group)
        return list(flags.split([len(u.params) for u in self.units]))

    def end_window(self) -> None:
        self.window_used = [[0] * len(u.params) for u in self.units]

    def discard_window(self) -> None:
        """After a backward that raised: forgets every gradient of the
        accumulation window, so that the next backward starts a new one.
        Reductions already started are waited for (the other ranks issued
        them too), their results dropped; a failure waiting is raised once
        all is forgotten."""
        failure: BaseException | None = None
        try:
            self._drop_unreduced()
        except BaseException as exc:  # noqa: BLE001 - raised below, once the window is forgotten
            failure = exc
        self.tracker.reset()
        self._late_unit = None
        self.end_window()
        try:
            self.zero_grads()
        except BaseException as exc:  # noqa: BLE001 - as above
            failure = failure or exc
        if failure is not None:
            raise failure

    # Policy-specific parts.
    def _reduces_this_micro_step(self) -> bool:
        raise NotImplementedError

    def _accumulate(self, unit: int, index: int, grad: torch.Tensor) -> None:
        raise NotImplementedError

    def _launch(self, units: list[int]) -> None:
        raise NotImplementedError

    def _retire_all(self) -> None:
        raise NotImplementedError

    def _drop_unreduced(self) -> None:
        """Waits for the reductions in flight without using their results,
        and forgets what was accumulated but not yet reduced."""
        raise NotImplementedError

    def grad_shard(self, unit: int) -> torch.Tensor:
        """The averaged fp32 gradient of this rank's shard (valid at the boundary)."""
        raise NotImplementedError

    def put_grad_shard(self, unit: int, values: torch.Tensor) -> None:
        """``values`` (``grad_shard(unit)``, changed) are the unit's gradient shard from now on."""
        raise NotImplementedError

    def squared_norm(self) -> torch.Tensor:
        """The sum of squares of this rank's gradient shards (float64 scalar)."""
        raise NotImplementedError

    def zero_grads(self) -> None:
        raise NotImplementedError

    def held_tensors(self) -> list[torch.Tensor]:
        """The gradient buffers held in memory now (memory report)."""
        raise NotImplementedError

    def close(self) -> None:
        """Removes a gradient swap file, if any."""


class AccumulateThenReduce(GradientReducer):
    """Stages 0 (``sharded=False``: all-reduce) and 1 (reduce-scatter)."""

    def __init__(
        self, units: list[Unit], world_size: int, reduce_dtype: torch.dtype, reduce_scatter: ReduceScatter,
        sharded: bool, group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        super().__init__(units, world_size, reduce_dtype, reduce_scatter, group)
        self.sharded = sharded
        # Stage 0: the optimizer, when it decides which steps' gradients are
        # averaged (zcore.initialize sets it); None: every step's are.
        self.averaging: Optional[GradientAveraging] = None
        self.acc = [torch.zeros(u.padded_numel, dtype=torch.float32, device=u.device) for u in units]
        self.shards = (
            [torch.zeros(u.shard_numel, dtype=torch.float32, device=u.device) for u in units]
            if sharded
            else self.acc
        )
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor, object]] = []

    def begin_micro_step(self, boundary: bool) -> None:
        super().begin_micro_step(boundary)
        if boundary:  # the optimizer's phase changes only in its step, before this
            self.averaged = self.averaging is None or self.averaging.takes_averaged_gradients()

    def _reduces_this_micro_step(self) -> bool:
        return self.boundary and self.averaged

    def _accumulate(self, unit: int, index: int, grad: torch.Tensor) -> None:
        self.units[unit].param_slice(self.acc[unit], index).add_(grad.reshape(-1))

    def _launch(self, units: list[int]) -> None:
        if not self._reduces_this_micro_step():
            return
        for u in units:
            send = self.acc[u].to(self.reduce_dtype)  # acc itself in fp32
            if self.predivide:  # send is a 16-bit copy
                send.div_(self.world_size)
            if self.sharded:
                out = torch.empty(self.units[u].shard_numel, dtype=self.reduce_dtype, device=send.device)
                work = self.reduce_scatter(out, send) if self.world_size > 1 else None
                if work is None:
                    out.copy_(send)
            else:
                out = send
                work = comm.all_reduce_sum(out, async_op=True, group=self.group) if self.world_size > 1 else None
            self._pending.append((u, out, send, work))

    def _retire_all(self) -> None:
        for u, out, _, work in self._pending:
            if work is not None:
                work.wait()
            self.shards[u].copy_(out)
            if not self.predivide:
                self.shards[u].div_(self.world_size)
        self._pending.clear()
        if self.boundary and self.sharded:
            for a in self.acc:
                a.zero_()

    def _drop_unreduced(self) -> None:
        try:
            _wait_all(self._pending)
        finally:
            for a in self.acc:
                a.zero_()

    def grad_shard(self, unit: int) -> torch.Tensor:
        return self.shards[unit]

    def put_grad_shard(self, unit: int, values: torch.Tensor) -> None:
        if values is not self.shards[unit]:
            self.shards[unit].copy_(values)

    def squared_norm(self) -> torch.Tensor:
        return squared_norm_of(self.shards)

    def zero_grads(self) -> None:
        for s in self.shards:
            s.zero_()

    def held_tensors(self) -> list[torch.Tensor]:
        return list(self.shards) + (list(self.acc) if self.sharded else [])


class ReduceScatterEveryMicroStep(GradientReducer):
    """Stages 2 and 3. With MiCS (stage 3), each bucket is reduce-scattered
    within the shard group every micro-step, and at the accumulation
    boundary each rank's window total is summed over its replicas (the
    ranks of other shard groups holding the same shard), once per step as
    DeepSpeed's MiCS does."""

    sharded = True  # each rank holds only its shard of the gradients

    def __init__(
        self, units: list[Unit], world_size: int, reduce_dtype: torch.dtype, reduce_scatter: ReduceScatter,
        grads: GradientShards | None = None, shard_size: int | None = None, replicas: RankGroup | None = None,
        group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        """``grads``: where the shards accumulate (default: in memory, on the
        device). ``shard_size``: the ranks ``reduce_scatter`` runs over
        (default: the world); ``replicas``: MiCS's replica group."""
        super().__init__(units, world_size, reduce_dtype, reduce_scatter, group)
        self.grads = grads if grads is not None else ResidentGradients(units)
        self.shard_size = world_size if shard_size is None else shard_size
        self.replicas = replicas
        self.buckets: list[torch.Tensor | None] = [None] * len(units)
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor, object]] = []

    def _bucket(self, unit: int) -> torch.Tensor:
        bucket = self.buckets[unit]
        if bucket is None:
            u = self.units[unit]
            bucket = torch.zeros(u.padded_numel, dtype=self.reduce_dtype, device=u.device)
            self.buckets[unit] = bucket
        return bucket

    def _reduces_this_micro_step(self) -> bool:
        return True

    def _accumulate(self, unit: int, index: int, grad: torch.Tensor) -> None:
        self.units[unit].param_slice(self._bucket(unit), index).add_(grad.reshape(-1))

    def _launch(self, units: list[int]) -> None:
        for u in units:
            send = self._bucket(u)
            self.buckets[u] = None
            if self.predivide:
                send.div_(self.world_size)
            out = torch.empty(self.units[u].shard_numel, dtype=self.reduce_dtype, device=send.device)
            if self.shard_size > 1:
                work = self.reduce_scatter(out, send)
            else:
                out.copy_(send)
                work = None
            self._pending.append((u, out, send, work))
            while len(self._pending) > MAX_REDUCES_IN_FLIGHT:
                self._retire(self._pending.pop(0))

    def _retire(self, entry: tuple[int, torch.Tensor, torch.Tensor, object]) -> None:
        u, out, _, work = entry
        if work is not None:
            work.wait()
        scale = 1.0 if self.predivide else 1.0 / self.world_size
        if self.replicas is None or not self.boundary:
            self.grads.add(u, out, scale, final=self.boundary)
            return
        total = self.grads.get(u).add(out.to(torch.float32), alpha=scale)
        comm.all_reduce_sum(total, group=self.replicas.group)
        self.grads.put(u, total)

    def _retire_all(self) -> None:
        for entry in self._pending:
            self._retire(entry)
        self._pending.clear()

    def _drop_unreduced(self) -> None:
        self.buckets = [None] * len(self.units)
        _wait_all(self._pending)

    def grad_shard(self, unit: int) -> torch.Tensor:
        return self.grads.get(unit)

    def put_grad_shard(self, unit: int, values: torch.Tensor) -> None:
        self.grads.put(unit, values)

    def squared_norm(self) -> torch.Tensor:
        return self.grads.squared_norm()

    def zero_grads(self) -> None:
        self.grads.zero()

    def held_tensors(self) -> list[torch.Tensor]:
        return self.grads.tensors()

    def close(self) -> None:
        self.grads.close()


def _wait_all(pending: list[tuple[int, torch.Tensor, torch.Tensor, object]]) -> None:
    """Waits for every work in ``pending`` and empties it; the first failure
    is raised after the others are waited for."""
    failure: BaseException | None = None
    for _, _, _, work in pending:
        try:
            if work is not None:
                work.wait()
        except BaseException as exc:  # noqa: BLE001 - the first is raised below
            failure = failure or exc
    pending.clear()
    if failure is not None:
        raise failure
