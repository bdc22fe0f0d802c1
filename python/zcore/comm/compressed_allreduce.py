"""The 1-bit all-reduce with error feedback behind 1-bit Adam and 0/1 Adam.

Each tensor is averaged over the ranks in two hops, each sending one bit
per element and one float32 scale per tensor (DeepSpeed's algorithm):

1. Worker. Every rank adds its *worker error* (what its earlier messages
   failed to carry) to the tensor, padded with zeros, and sends the signs
   and the scale ``||x|| / sqrt(n)`` (``n``: padded elements, so the
   decoded vector has the norm of ``x``); what the signs times the scale
   miss becomes the new worker error. Chunk r of the signs goes to rank r.
2. Server. Rank r owns chunk r: it averages the chunks it received
   (sign times sender's scale, over the ranks), adds its *server error*,
   compresses that again the same way, keeps the new server error, and
   every rank gathers every server's chunk.

A sign is +1 for x >= 0 (zero and NaN included) and -1 below, as in
DeepSpeed. Signs travel 8 per byte, most significant bit first; a
message is each tensor's packed signs then its scale's 4 bytes, for every
tensor of the call, so that one all-to-all and one all-gather serve them
all while each tensor keeps its own scale and padding, as it has in
DeepSpeed, where each tensor makes its own calls.

The error-feedback identity (tested): with zero initial errors, after T
calls the outputs summed equal the true means summed, minus the ranks'
mean worker error and the concatenated server errors. Errors stay
bounded, so the average output converges to the average mean.

The collectives go through torch.distributed on the default group
(zcore.comm.collectives), whatever its backend: DeepSpeed's ``comm_backend_name``
("nccl", "compressed") chooses an implementation of these same two hops.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zcore.comm import collectives as comm
from zcore.errors import InvalidArgumentError

_SCALE_BYTES = 4  # a float32 scale, sent as bytes beside the signs


def padded_numel(numel: int, world_size: int) -> int:
    """``numel`` rounded up to a multiple of ``world_size * lcm(world_size,
    8)``: DeepSpeed's padding. Each server's chunk then packs into whole
    bytes. It is 8 x world_size when world_size divides 8; the padding
    enters the scales (through ``n``), so it is DeepSpeed's to match its
    results at every world size."""
    multiple = world_size * math.lcm(world_size, 8)
    return -(-numel // multiple) * multiple


@dataclass
class ErrorFeedback:
    """One tensor's compression errors on this rank."""

    worker: torch.Tensor  # padded_numel elements: what this rank's messages missed
    server: torch.Tensor  # padded_numel / world elements: what its server chunk missed

    @classmethod
    def zeros(cls, numel: int, world_size: int, device: torch.device) -> ErrorFeedback:
        padded = padded_numel(numel, world_size)
        return cls(
            worker=torch.zeros(padded, dtype=torch.float32, device=device),
            server=torch.zeros(padded // world_size, dtype=torch.float32, device=device),
        )

    def zero_(self) -> None:
        self.worker.zero_()
        self.server.zero_()


def compressed_all_reduce(tensors: Sequence[torch.Tensor], errors: Sequence[ErrorFeedback]) -> None:
    """Replaces each flat fp32 tensor by the 1-bit estimate of its mean over
    the ranks, updating its errors (``errors[i]`` for ``tensors[i]``). Every
    rank must call it with tensors of the same sizes in the same order.
    In a world of one nothing is sent, so nothing is lost: the tensors and
    errors are left as they are."""
    if len(tensors) != len(errors):
        raise InvalidArgumentError(f"{len(tensors)} tensors but {len(errors)} ErrorFeedback: pass one per tensor")
    world = dist.get_world_size() if dist.is_initialized() else 1
    pairs = [(t, e) for t, e in zip(tensors, errors) if t.numel() > 0]
    if world == 1 or not pairs:
        return
    for t, e in pairs:
        _check(t, e, world)
    widths = [e.server.numel() // 8 + _SCALE_BYTES for _, e in pairs]  # bytes per chunk message
    sent = torch.cat([_worker_message(t, e, world) for t, e in pairs], dim=1)
    received = torch.empty_like(sent)  # row r: rank r's messages for the chunks this rank serves
    comm.all_to_all(received, sent)
    served = torch.cat(
        [_server_message(part, e, world) for part, (_, e) in zip(received.split(widths, dim=1), pairs)]
    )
    gathered = torch.empty(world, served.numel(), dtype=torch.uint8, device=served.device)
    comm.all_gather_into(gathered, served)
    for part, (t, _) in zip(gathered.split(widths, dim=1), pairs):
        t.copy_(_decode(part).reshape(-1)[: t.numel()])


def _check(tensor: torch.Tensor, error: ErrorFeedback, world: int) -> None:
    padded = padded_numel(tensor.numel(), world)
    if tensor.dtype != torch.float32 or tensor.dim() != 1:
        raise InvalidArgumentError(
            f"compressed_all_reduce takes flat float32 tensors, got dtype={tensor.dtype} shape={tuple(tensor.shape)}"
        )
    if error.worker.numel() != padded or error.server.numel() != padded // world:
        raise InvalidArgumentError(
            f"the errors of a {tensor.numel()}-element tensor at world size {world} hold {padded} (worker) and "
            f"{padded // world} (server) elements, not {error.worker.numel()} and {error.server.numel()}; "
            "make them with ErrorFeedback.zeros(numel, world_size, device)"
        )


def _compress(x: torch.Tensor, error: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Signs (bool, True for +1) and scale of ``x``; ``error`` becomes
    what they miss. ``x`` already holds the previous error."""
    scale = torch.linalg.vector_norm(x) / math.sqrt(x.numel())
    positive = ~(x < 0)  # NaN and -0.0 count as +1, as DeepSpeed's sign()+1 does
    error.copy_(x - scale * _signs(positive))
    return positive, scale.reshape(1)


def _worker_message(tensor: torch.Tensor, error: ErrorFeedback, world: int) -> torch.Tensor:
    """(world, chunk bytes + 4): row r is what goes to rank r."""
    x = error.worker.clone()
    x[: tensor.numel()] += tensor
    positive, scale = _compress(x, error.worker)
    packed = _pack(positive.view(world, -1))
    return torch.cat([packed, scale.view(torch.uint8).expand(world, _SCALE_BYTES)], dim=1)


def _server_message(received: torch.Tensor, error: ErrorFeedback, world: int) -> torch.Tensor:
    """This rank's chunk, averaged from every rank's message and compressed
    again: its packed signs and scale, flat."""
    mean = _decode(received).mul_(1.0 / world).sum(dim=0)
    mean += error.server
    positive, scale = _compress(mean, error.server)
    return torch.cat([_pack(positive), scale.view(torch.uint8)])


def _decode(messages: torch.Tensor) -> torch.Tensor:
    """(ranks, chunk bytes + 4) messages to (ranks, chunk) values: sign x scale."""
    signs = _signs(_unpack(messages[:, :-_SCALE_BYTES]))
    scales = messages[:, -_SCALE_BYTES:].contiguous().view(torch.float32)
    return signs.mul_(scales)


_BITS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def _pack(positive: torch.Tensor) -> torch.Tensor:
    """Bools (..., 8k) to bytes (..., k), the first of each 8 the high bit."""
    bits = positive.reshape(*positive.shape[:-1], -1, 8).to(torch.uint8)
    return (bits * _BITS.to(bits.device)).sum(dim=-1, dtype=torch.uint8)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """Bytes (..., k) to bools (..., 8k)."""
    bits = packed.unsqueeze(-1).bitwise_and(_BITS.to(packed.device)) != 0
    return bits.reshape(*packed.shape[:-1], -1)


def _signs(positive: torch.Tensor) -> torch.Tensor:
    """+1.0 where True, -1.0 where False (float32)."""
    return positive.to(torch.float32).mul_(2.0).sub_(1.0)
