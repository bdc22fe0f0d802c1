"""Bytes per rank: measured from the tensors zcore holds, beside the figures
the stage's layout predicts for this model."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zcore.grad_reduction import AccumulateThenReduce
from zcore.sharded_optimizer import ShardedOptimizer


@dataclass(frozen=True)
class MemoryFigures:
    parameters: int
    gradients: int
    optimizer_states: int
    buffers: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_states + self.buffers


@dataclass(frozen=True)
class MemoryReport:
    stage: int
    world_size: int
    trainable_parameters: int  # elements
    measured: MemoryFigures
    theoretical: MemoryFigures

    def __str__(self) -> str:
        rows = [f"zcore memory per rank (stage {self.stage}, world size {self.world_size})"]
        rows.append(f"{'':18}{'measured':>14}{'theoretical':>14}")
        for name in ("parameters", "gradients", "optimizer_states", "buffers", "total"):
            m, t = getattr(self.measured, name), getattr(self.theoretical, name)
            rows.append(f"{name:18}{m / 2**20:>11.2f} MiB{t / 2**20:>11.2f} MiB")
        return "\n".join(rows)


def _tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def measure_memory(
    module: torch.nn.Module,
    optimizer: ShardedOptimizer,
    stage: int,
    world_size: int,
    stored_params: list[torch.Tensor],
) -> MemoryReport:
    """``stored_params``: the tensors holding parameters between uses (whole
    units in stages 0-2; shards and persistent gathered groups in stage 3)."""
    units = optimizer.units
    reducer = optimizer.reducer
    in_units = {id(p) for u in units for p in u.params}
    others = [p for p in module.parameters() if id(p) not in in_units]

    unit_param_bytes = _tensor_bytes(stored_params)
    grad_tensors = list(reducer.shards)
    if isinstance(reducer, AccumulateThenReduce) and reducer.sharded:
        grad_tensors += reducer.acc
    measured = MemoryFigures(
        parameters=unit_param_bytes + _tensor_bytes(others),
        gradients=_tensor_bytes(grad_tensors),
        optimizer_states=optimizer.state_bytes(),
        buffers=_tensor_bytes(module.buffers()),
    )

    # The layout's prediction: compute-dtype parameters, fp32 gradients (a
    # full-size accumulator in stages 0 and 1, this rank's shard in stages 1
    # and 2), and 12 bytes per element of this rank's shard for fp32 Adam
    # (master, exp_avg, exp_avg_sq).
    psi = sum(u.numel for u in units)
    shards = 1 if stage == 0 else world_size
    shard_elems = sum(u.shard_numel for u in units) if units else 0
    padded = sum(u.padded_numel for u in units)
    itemsize = units[0].dtype.itemsize if units else 4
    grads = {0: 4 * padded, 1: 4 * padded + 4 * shard_elems, 2: 4 * shard_elems, 3: 4 * shard_elems}[stage]
    param_shards = world_size if stage == 3 else 1
    theoretical = MemoryFigures(
        parameters=psi * itemsize // param_shards + _tensor_bytes(others),
        gradients=grads,
        optimizer_states=12 * psi // shards,
        buffers=measured.buffers,
    )
    return MemoryReport(
        stage=stage,
        world_size=world_size,
        trainable_parameters=psi,
        measured=measured,
        theoretical=theoretical,
    )
