"""Where each rank's fp32 gradient shards accumulate between optimizer steps.

- ``ResidentGradients``: one fp32 tensor per unit on the compute device,
  allocated at the unit's first gradient of an accumulation window and
  freed when the step zeroes the gradients, as DeepSpeed frees its fp32
  partition gradients and FSDP2 its sharded ones: the forward passes run
  without them (4 bytes per trained element of the shard less at the peak).
- ``SwappedGradients``: with the optimizer states on NVMe (stages 2 and 3),
  the gradients go there too, as the issue's "gradient shards go where the
  optimizer runs" asks: a unit's shard is one key of this rank's gradient
  swap file. The first contribution of an accumulation window is written
  as it is; later ones read, add and write back. At the window's last
  micro-step, the final values' sum of squares is kept per unit, so that
  clipping and the overflow check need no extra pass over the disk. Host
  memory: the writes in flight (bounded) and the unit being read.
"""

from __future__ import annotations

from collections import OrderedDict
import torch

from zcore.memory.staging import page_placed
from zcore.step.units import Unit
from zcore.memory.swap import SwapManager


def squared_norm_of(shards: list[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """The sum of squares of every shard, as a float64 scalar on their device
    (``device``, or the CPU, for no shard).
    Summed in float64: the global norm, and so the clipping coefficient in
    fp32, is then the same however the gradients are sharded (a matrix
    optimizer's bfloat16 iteration turns a last-bit difference into a visible one)."""
    device = shards[0].device if shards else device or torch.device("cpu")
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for shard in shards:
        squares += squared_norm(shard)
    return squares


def squared_norm(t: torch.Tensor) -> torch.Tensor:
    """The sum of squares of ``t``'s elements, computed in float64."""
    return torch.linalg.vector_norm(t, dtype=torch.float64) ** 2


class ResidentGradients:
    def __init__(self, units: list[Unit]) -> None:
        self.units = units
        self.device = units[0].device if units else torch.device("cpu")
        self.shards: list[torch.Tensor | None] = [None] * len(units)  # None: no gradient this window

    def add(self, unit: int, values: torch.Tensor, alpha: float, final: bool) -> None:
        self.get(unit).add_(values.to(torch.float32), alpha=alpha)

    def put(self, unit: int, values: torch.Tensor) -> None:
        """The unit's final values of the window."""
        self.get(unit).copy_(values)

    def get(self, unit: int) -> torch.Tensor:
        """The unit's shard, zeros until its first gradient of the window."""
        shard = self.shards[unit]
        if shard is None:
            u = self.units[unit]
            shard = self.shards[unit] = torch.zeros(u.shard_numel, dtype=torch.float32, device=u.device)
        return shard

    def squared_norm(self) -> torch.Tensor:
        return squared_norm_of(self.tensors(), self.device)

    def zero(self) -> None:
        self.shards = [None] * len(self.units)

    def tensors(self) -> list[torch.Tensor]:
        """What is held in memory now (between steps: nothing)."""
        return [s for s in self.shards if s is not None]

    def close(self) -> None:
        return None


class SwappedGradients:
    def __init__(self, units: list[Unit], swap: SwapManager, pending_limit: int) -> None:
        """``pending_limit``: bytes of writes in flight before the oldest is waited for."""
        self.units = units
        self.swap = swap
        self._limit = pending_limit
        self._written: set[int] = set()  # units with values on disk this window
        self._writing: OrderedDict[int, torch.Tensor] = OrderedDict()  # unit -> values being written
        self._squares: dict[int, float] = {}  # unit -> sum of squares of its final values

    def add(self, unit: int, values: torch.Tensor, alpha: float, final: bool) -> None:
        """Adds ``alpha * values`` to the unit's shard; ``final``: the last
        contribution of the window."""
        if unit in self._written:
            total = self._read(unit)
            total.add_(values.to(device="cpu", dtype=torch.float32), alpha=alpha)
        else:
            total = values.to(device="cpu", dtype=torch.float32, copy=True).mul_(alpha)
        if final:
            self._squares[unit] = float(squared_norm(total))
        self._write(unit, total)

    def put(self, unit: int, values: torch.Tensor) -> None:
        """The unit's final values of the window (fp32, kept until written)."""
        total = values.to(device="cpu", dtype=torch.float32)
        self._squares[unit] = float(squared_norm(total))
        self._write(unit, total)

    def get(self, unit: int) -> torch.Tensor:
        """The unit's shard (zeros when it got no gradient this window), on the host."""
        if unit not in self._written:
            return torch.zeros(self.units[unit].shard_numel, dtype=torch.float32)
        return self._read(unit)

    def squared_norm(self) -> torch.Tensor:
        return torch.tensor(sum(self._squares.values()), dtype=torch.float64)

    def zero(self) -> None:
        try:
            self._finish_writes()
        finally:  # a failed write's values are gone either way
            self._written.clear()
            self._squares.clear()

    def tensors(self) -> list[torch.Tensor]:
        return []  # on NVMe between steps

    def nvme_bytes(self) -> int:
        return self.swap.stats().used

    def close(self) -> None:
        self.swap.close()

    def _read(self, unit: int) -> torch.Tensor:
        writing = self._writing.pop(unit, None)
        if writing is not None:
            self.swap.wait(unit)
            return writing
        # Not a pool buffer: the optimizer keeps the shards of a sub-group's
        # units at once, which a pool sized for one unit cannot hold.
        values = page_placed(self.units[unit].shard_numel * 4).view(torch.float32)
        self.swap.swap_in(unit, values)
        self.swap.wait(unit)
        return values

    def _write(self, unit: int, values: torch.Tensor) -> None:
        self.swap.swap_out(unit, values)
        self._writing[unit] = values
        self._written.add(unit)
        while sum(t.numel() * 4 for t in self._writing.values()) > self._limit and len(self._writing) > 1:
            oldest, _ = self._writing.popitem(last=False)
            self.swap.wait(oldest)

    def _finish_writes(self) -> None:
        """Waits for every write in flight (their buffers stay alive until
        then), raising the first failure once all are done."""
        failure: BaseException | None = None
        while self._writing:
            unit, _ = self._writing.popitem(last=False)
            try:
                self.swap.wait(unit)
            except BaseException as exc:  # noqa: BLE001 - raised below
                failure = failure or exc
        if failure is not None:
            raise failure


GradientShards = ResidentGradients | SwappedGradients


def swap_capacity(units: list[Unit], alignment: int) -> int:
    return sum(-(-u.shard_numel * 4 // alignment) * alignment for u in units)

