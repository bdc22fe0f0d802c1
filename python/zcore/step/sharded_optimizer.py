"""The optimizer step over this rank's shard of every unit.

Each rank holds fp32 master weights for its shards only, and a torch
optimizer whose parameters are *pieces*: views into the master shards, one
per parameter that overlaps the shard, grouped as the user's parameter groups
were. At a boundary it unscales, checks for overflow, clips by the global
norm, steps, writes the updated shard back into the compute-dtype parameters
and publishes them (a policy: all-gather the units in stages 1 and 2; in
stage 3 parameters are gathered on demand, so only what stays gathered is
refreshed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from zcore import tracing
from zcore.comm import collectives as comm
from zcore.step.background_step import BackgroundStep, StepState
from zcore.step.grad_reduction import GradientReducer
from zcore.step.gradient_shards import squared_norm_of
from zcore.parallel.mesh import ModelParallelMesh, global_squared_norm, replicated_pieces
from zcore.optim import CPUAdam
from zcore.step.units import FlatUnit, Unit
from zcore.step.precision import MixedPrecision
from zcore.comm.topology import RankGroup

if TYPE_CHECKING:
    from zcore.parallel.pipelining import Tie


@dataclass(frozen=True)
class StepResult:
    skipped: bool  # an overflow (fp16) skipped the update on every rank
    grad_norm: Optional[float]  # global norm before clipping, when computed


def pieces_by_param(units: list[Unit], pieces: list[list[torch.nn.Parameter]]) -> dict[int, list[torch.nn.Parameter]]:
    """The optimizer's pieces of each model parameter (keyed by id), for its groups;
    ``pieces[u][k]`` stands for ``units[u].pieces[k]``."""
    out: dict[int, list[torch.nn.Parameter]] = {}
    for unit, unit_pieces in zip(units, pieces):
        for meta, piece in zip(unit.pieces, unit_pieces):
            out.setdefault(id(unit.params[meta.param_index]), []).append(piece)
    return out


class MasterShards:
    """Master copies of this rank's shards (fp32, or bf16: DeepSpeed's
    bf16_master_weights_and_grads) and the pieces viewing them."""

    def __init__(
        self, units: list[Unit], device: torch.device, pin_memory: bool = False, dtype: torch.dtype = torch.float32
    ) -> None:
        """Zero until ``take`` gives each unit's values."""
        self.units = units
        # Offloaded shards: page-locked for fast copies to and from the GPU.
        self.shards = [
            torch.zeros(u.shard_numel, dtype=dtype, device=device, pin_memory=pin_memory) for u in units
        ]
        # pieces[u][k] views self.shards[u] for units[u].pieces[k].
        self.pieces = [
            [
                torch.nn.Parameter(shard[p.shard_start : p.shard_start + p.numel])
                for p in unit.pieces
            ]
            for unit, shard in zip(units, self.shards)
        ]

    def piece_of(self) -> dict[int, list[torch.nn.Parameter]]:
        return pieces_by_param(self.units, self.pieces)

    def take(self, unit: int, values: torch.Tensor) -> None:
        """At start-up: unit ``unit``'s shard values (before any cast)."""
        self.shards[unit].copy_(values)

    def finish(self) -> None:
        return None

    def numel(self) -> int:
        return sum(s.numel() for s in self.shards)


class UnitShards:
    """Where the optimizer reads and writes each unit's compute-dtype shard:
    in the unit's ``local_shard``, in place (stages 0-2, and stage 3 shards
    in device or host memory)."""

    def resident(self, unit: Unit) -> Optional[torch.Tensor]:
        """The shard in memory, to be written in place; None when it is not."""
        return unit.local_shard

    def read(self, unit: Unit) -> torch.Tensor:
        return unit.local_shard

    def write(self, unit: Unit, values: torch.Tensor) -> None:
        unit.local_shard.copy_(values)


class StoredShards(UnitShards):
    """Stage 3: shards through the parameter fetcher's shard store, which
    writes NVMe shards out (zcore.zero3.shard_store)."""

    def __init__(self, fetcher: Any) -> None:
        self.fetcher = fetcher

    def resident(self, unit: Unit) -> Optional[torch.Tensor]:
        return unit.local_shard if unit.in_memory else None

    def read(self, unit: Unit) -> torch.Tensor:
        return self.fetcher.read_shard(unit.index)

    def write(self, unit: Unit, values: torch.Tensor) -> None:
        self.fetcher.write_shard(unit.index, values)


class TorchUpdate:
    """The inner torch optimizer updates the master shards where they live;
    the result is then cast into the parameters' shards."""

    def __init__(
        self, inner: torch.optim.Optimizer, master: MasterShards, reducer: GradientReducer, shards: UnitShards
    ) -> None:
        self.inner = inner
        self.master = master
        self.reducer = reducer
        self.shards = shards
        offloaded = any(s.device != u.device for s, u in zip(master.shards, master.units))
        # Offloaded masters need their gradients beside them, in their dtype
        # (torch gives a parameter gradients of its own dtype), page-locked as
        # the masters are: pageable, the copy from the GPU ran at a third of
        # the pinned bandwidth on an H200 (bench/RESULTS.md).
        self.host_grads = (
            [torch.empty(s.shape, dtype=s.dtype, pin_memory=s.is_pinned()) for s in master.shards]
            if offloaded
            else None
        )
        # Per unit while attached: the gradient shard, and what the pieces
        # view (the same, or its cast: bf16 masters in device memory).
        self.grads: list[tuple[torch.Tensor, torch.Tensor]] = []

    def grad_source(self, unit: int) -> torch.Tensor:
        shard = self.reducer.grad_shard(unit)
        if self.host_grads is None:
            return shard
        return self.host_grads[unit].copy_(shard)

    def attach_grads(self, used: list[torch.Tensor]) -> None:
        """Each piece's gradient, where ``used[u]`` flags unit u's
        parameters that got one. A parameter that got no gradient on any
        rank keeps grad None, so the optimizer skips it (no decay, no moment
        update), as torch.optim does."""
        self.grads = []
        for u, unit in enumerate(self.master.units):
            source = self.grad_source(u)
            dtype = self.master.shards[u].dtype
            shard = source if source.dtype == dtype else torch.empty_like(source, dtype=dtype)
            self.grads.append((source, shard))
            flags = used[u].tolist()  # indexing the tensor costs microseconds per piece
            for meta, piece in zip(unit.pieces, self.master.pieces[u]):
                if flags[meta.param_index]:
                    piece.grad = shard[meta.shard_start : meta.shard_start + meta.numel]
                else:
                    piece.grad = None

    def scale_grads(self, coefficient: float) -> None:
        """The attached gradients times ``coefficient``; a cast one is
        scaled in its source's precision and rounded once (and is then the
        pieces' gradient alone: a later call scales it as it is)."""
        for i, (source, shard) in enumerate(self.grads):
            if shard is not source:
                torch.mul(source, coefficient, out=shard)
                self.grads[i] = (shard, shard)
            elif coefficient != 1.0:
                shard.mul_(coefficient)

    def detach_grads(self) -> None:
        self.grads = []
        for pieces in self.master.pieces:
            for piece in pieces:
                piece.grad = None

    def close(self) -> None:
        return None

    def check_saveable(self) -> None:
        """Raises CheckpointError where a checkpoint cannot hold the
        optimizer's state (zcore.step.matrix_step); the same on every rank."""
        return None

    def state_bytes(self) -> int:
        """Bytes of optimizer state in memory: the master plus the inner
        optimizer's state tensors."""
        total = sum(s.numel() * s.element_size() for s in self.master.shards)
        for state in self.inner.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    total += value.numel() * value.element_size()
        return total

    def apply(self, coefficient: float) -> None:
        self.scale_grads(coefficient)
        self.inner.step()
        for unit, shard in zip(self.master.units, self.master.shards):
            self.shards.write(unit, shard)


class FusedCpuUpdate(TorchUpdate):
    """ZeRO-Offload: zcore's CPU Adam updates the host master shards, applying
    the gradient scale and writing the bf16/fp16 parameters in the same pass;
    the written shards then go to the parameters' device."""

    def __init__(self, inner: CPUAdam, master: MasterShards, reducer: GradientReducer, shards: UnitShards) -> None:
        super().__init__(inner, master, reducer, shards)
        compute = master.units[0].dtype if master.units else torch.float32
        self.fused_copy = compute in (torch.bfloat16, torch.float16)
        self.outs: dict[torch.Tensor, torch.Tensor] = {}
        self.staging: list[torch.Tensor] = []
        self.in_place: list[bool] = []
        for unit, pieces, master_shard in zip(master.units, master.pieces, master.shards):
            local = shards.resident(unit)
            in_place = local is not None and local.device.type == "cpu"
            # Copied to the device after each step: page-locked as the master is.
            staging = (
                local
                if in_place
                else torch.empty(unit.shard_numel, dtype=compute, pin_memory=master_shard.is_pinned())
            )
            self.staging.append(staging)
            self.in_place.append(in_place)
            for meta, piece in zip(unit.pieces, pieces):
                self.outs[piece] = staging[meta.shard_start : meta.shard_start + meta.numel]

    def apply(self, coefficient: float) -> None:
        if not self.fused_copy:
            super().apply(coefficient)
            return
        if any(shard is not source for source, shard in self.grads):
            self.scale_grads(coefficient)  # bf16 masters beside their gradients: cast once, scaled
            coefficient = 1.0
        self.inner.fused_step(grad_scale=coefficient, params_out=self.outs)
        for unit, staging, in_place in zip(self.master.units, self.staging, self.in_place):
            if not in_place:
                self.shards.write(unit, staging)


class Publisher(Protocol):
    def publish(self) -> None:
        """Makes the updated shards visible to the forward passes to come."""


class GatherUnits:
    """Stages 1 and 2: every rank's updated shards into every rank's units."""

    def __init__(self, units: list[FlatUnit], group: Optional[dist.ProcessGroup] = None) -> None:
        """``group``: the data-parallel ranks (None: the world)."""
        self.units = units
        self.group = group

    def publish(self) -> None:
        works = [
            comm.all_gather_into(unit.flat, unit.local_shard.clone(), async_op=True, group=self.group)
            for unit in self.units
        ]
        comm.wait_all(works)


class KeepUnits:
    """Stage 0, or a world of one: the shard is the whole unit already."""

    def publish(self) -> None:
        return None


class ShardedOptimizer:
    """What ``engine.optimizer`` is: the inner torch optimizer over pieces,
    plus the ZeRO step around it."""

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        master: MasterShards,
        reducer: GradientReducer,
        update: TorchUpdate,
        precision: MixedPrecision,
        gradient_clipping: float,
        shard: RankGroup,
        publisher: Publisher,
        group_params: list[list[torch.nn.Parameter]],
        model_parallel: Optional[ModelParallelMesh] = None,
        ties: Sequence[Tie] = (),
    ) -> None:
        """``model_parallel``: the mesh zcore shards the "dp" dimension of,
        for the norm over all of it (zcore.parallel.mesh); ``ties``: units
        holding a weight tied across pipeline stages (zcore.parallel.pipelining)."""
        self.inner = inner
        self.master = master
        self.reducer = reducer
        self.update = update
        self.precision = precision
        self.gradient_clipping = gradient_clipping
        self.measures_norm = False  # every step's gradient norm, for the step metrics
        self.shard = shard  # the ranks whose gradient shards make up the whole (MiCS: the shard group)
        self.publisher = publisher
        self.units = master.units
        # The model parameters of each of the user's groups (the inner
        # optimizer sees only this rank's pieces of them).
        self.group_params = group_params
        self.model_parallel = model_parallel
        self.ties = ties
        # Pieces every tp rank holds whole, counted once over tp; a tied copy
        # that another stage counts is left out of the norm altogether.
        uncounted = {t.unit for t in ties if not t.counted}
        self._replicated = [
            piece for piece in (replicated_pieces(self.units) if model_parallel is not None else [])
            if piece[0] not in uncounted
        ]

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    @property
    def loss_scale(self) -> float:
        return self.precision.scaler.scale

    def step(self) -> StepResult:
        scaler = self.precision.scaler
        used = self.reducer.used_params()
        for tie in self.ties:  # every copy of a tied weight takes the sum of their gradients
            comm.all_reduce_max(used[tie.unit], group=tie.group)
            comm.all_reduce_sum(self.reducer.grad_shard(tie.unit), group=tie.group)
        self.update.attach_grads(used)
        inv_scale = 1.0 / scaler.scale
        norm = None
        acts_on_norm = self.gradient_clipping > 0 or scaler.checks_overflow
        if acts_on_norm or self.measures_norm:
            norm = self._global_norm(inv_scale)
            if acts_on_norm and not self._finite_on_every_rank(norm):
                scaler.update(overflow=True)
                self._end_step()
                return StepResult(skipped=True, grad_norm=norm)
        coefficient = inv_scale
        if self.gradient_clipping > 0:
            clip = self.gradient_clipping / (norm + 1e-6)  # torch.nn.utils.clip_grad_norm_
            if clip < 1.0:
                coefficient *= clip
        with tracing.span("optimizer_step"):
            self.update.apply(coefficient)
        scaler.update(overflow=False)
        background = self._background()
        if background is not None and background.state is StepState.RUNNING:
            # The update goes on behind the next forward (zcore.step.background_step);
            # finish_step() ends it.
            self.publisher.publish_behind(self.update.wait_group, self.finish_step)
            return StepResult(skipped=False, grad_norm=norm)
        self.publisher.publish()
        self._end_step()
        return StepResult(skipped=False, grad_norm=norm)

    def _background(self) -> Optional[BackgroundStep]:
        """The worker of a step that may run behind the forward (only an
        NVMe optimizer at stage 3 has one)."""
        return getattr(self.update, "background", None)

    @property
    def step_failed(self) -> bool:
        """A step going on behind the forward failed part-way."""
        background = self._background()
        return background is not None and background.failed

    def forget_failed_step(self) -> None:
        """A checkpoint load replaced every state a failed step left."""
        background = self._background()
        if background is not None and background.state is StepState.FAILED:
            background.reset()
            self.publisher.update_complete()
            self._end_step()

    def finish_step(self) -> None:
        """Waits for a step running behind the forward and completes it (a
        no-op otherwise); raises what failed in it. Before anything that
        needs the whole update: backward, the next step, checkpoints. No
        collective: any rank may call it alone."""
        background = self._background()
        if background is None or background.state is StepState.IDLE:
            return
        running = background.state is StepState.RUNNING
        background.finish()
        if running:
            self.publisher.update_complete()
            self._end_step()

    def _global_norm(self, inv_scale: float) -> float:
        squares = self.reducer.squared_norm()
        if self.units:  # the collective runs on the units' device: NCCL has no CPU tensors
            squares = squares.to(self.units[0].device)
        if self.model_parallel is not None:
            pieces = [self.reducer.grad_shard(u)[start : start + n] for u, start, n in self._replicated]
            replicated = squared_norm_of(pieces).to(squares.device)
            copies = squared_norm_of([self.reducer.grad_shard(t.unit) for t in self.ties if not t.counted])
            squares = global_squared_norm(
                squares - copies.to(squares.device), replicated, self.reducer.sharded, self.model_parallel
            )
            return math.sqrt(squares.item()) * inv_scale
        # Stage 0 reduces whole gradients: every rank already has the total
        # (or, on a step where the optimizer averages itself, its own norm).
        if self.reducer.sharded and self.shard.size > 1:
            comm.all_reduce_sum(squares, group=self.shard.group)
        return math.sqrt(squares.item()) * inv_scale

    def _finite_on_every_rank(self, norm: float) -> bool:
        """Whether no rank's gradients overflowed. Averaged gradients are the
        same everywhere, so each rank knows. A rank's own gradients (an
        optimizer that averages itself: zcore.optim.CompressedAdam) are
        clipped by their own norm, as DeepSpeed does, but an overflow on any
        rank skips the step on all, as DeepSpeed's check agrees then too."""
        finite = math.isfinite(norm)
        if self.reducer.averaged:
            return finite
        device = self.units[0].device if self.units else torch.device("cpu")
        overflowed = torch.tensor([0 if finite else 1], dtype=torch.int32, device=device)
        comm.all_reduce_max(overflowed)
        return overflowed.item() == 0

    def _end_step(self) -> None:
        self.update.detach_grads()
        self.reducer.zero_grads()
        self.reducer.end_window()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.reducer.zero_grads()

    def state_bytes(self) -> int:
        """Bytes of optimizer state in memory on this rank (fp32 master and
        the inner optimizer's states)."""
        return self.update.state_bytes()

    def check_saveable(self) -> None:
        """Raises CheckpointError, on every rank alike, where a checkpoint
        cannot hold the optimizer's state yet."""
        self.update.check_saveable()

    def close(self) -> None:
        """Removes the swap file of optimizer states on NVMe, if any."""
        self.update.close()
