"""The copy an asynchronous save writes from: this rank's payload in host
memory zcore owns.

Training changes the live values in place at its next step (master shards,
optimizer states, NVMe sub-groups rewritten under the same swap keys), so
the background writer cannot read them: every tensor of the payload is
copied once into one buffer. What a forward or the caller may change
(buffers, client_state tensors, RNG) is copied while the training loop
waits. What only the optimizer step or a load changes (trained values,
their states, frozen parameters) may be copied later, by the writer's
thread, while the next forward and backward run, where every value lives in
memory (``RankPayload.in_memory``); the step and loads wait for that copy
(zcore.checkpoint.async_save). States on NVMe are read into the buffer
while the loop waits. Keeping them on disk "by reference" would
need the next optimizer step to wait until the writer had read every
sub-group (the step rewrites each in place), and the optimizer's swap file
to be read from two threads; the copy costs one read at NVMe speed instead,
and leaves the step free.

The buffer is as large as the rank's checkpoint data (each tensor at a
64-byte boundary) and is kept between saves, so that a later save does not
fault its pages in again; ``SnapshotBuffer.held_bytes`` is what
``engine.memory_report()`` shows. One save's copy at a time: a save waits
for the previous one before copying (zcore.checkpoint.async_save).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Callable, Optional

import torch

from zcore.memory.host_memory import PAGE_ALIGNMENT, HostMemory, as_tensor
from zcore.checkpoint.rank_payload import RankPayload
from zcore.checkpoint.tensor_file import TensorSpec

ALIGN = 64  # bytes between tensors: any dtype's alignment, and a cache line


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def snapshot_bytes(specs: list[TensorSpec]) -> int:
    """The bytes a copy of tensors ``specs`` takes in the buffer."""
    return sum(_aligned(spec.nbytes) for spec in specs)


class SnapshotBuffer:
    """One host buffer, grown when a payload needs more, released by ``close``."""

    def __init__(self) -> None:
        self._bytes: Optional[torch.Tensor] = None  # uint8 over native host memory

    @property
    def held_bytes(self) -> int:
        return 0 if self._bytes is None else self._bytes.numel()

    def copy(self, payload: RankPayload, defer_settled: bool = False) -> tuple[RankPayload, Callable[[], None]]:
        """``payload`` with its values copied here, read from where they live;
        the copy stays valid until the next ``copy`` or ``close``. With
        ``defer_settled`` (an in-memory payload only), the settled values are
        copied by the function returned, which must run before any of them
        changes; otherwise that function does nothing."""
        if defer_settled and not payload.in_memory:
            raise ValueError("only an in-memory payload's copy can be deferred: its values are views of the live ones")
        size = snapshot_bytes(payload.weight_specs + payload.state_specs)
        if self._bytes is None or self._bytes.numel() < size:
            self._bytes = None  # the old buffer goes before the larger one is taken
            self._bytes = as_tensor(HostMemory(size + PAGE_ALIGNMENT).buffer(max(size, 1)))
        copies: list[tuple[str, torch.Tensor]] = []
        later: list[tuple[torch.Tensor, torch.Tensor]] = []
        offset = 0
        for file, value, settled in payload.values():
            nbytes = value.numel() * value.element_size()
            target = self._bytes[offset : offset + nbytes].view(value.dtype).view(value.shape)
            if defer_settled and settled:
                later.append((target, value))
            else:
                target.copy_(value)
            copies.append((file, target))
            offset += _aligned(nbytes)

        def finish() -> None:
            for target, value in later:
                target.copy_(value)

        def stream() -> Iterator[tuple[str, torch.Tensor, bool]]:
            for file, target in copies:
                yield file, target, True

        return replace(payload, values=stream), finish

    def close(self) -> None:
        self._bytes = None
