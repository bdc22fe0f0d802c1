"""Activations of a model before it trains: the bytes autograd saves in
one training forward of a sample input, run on the meta device so that
nothing is computed or allocated (zcore.plan.estimate's activation figure)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional, Union

import torch

from zcore.step.precision import MixedPrecision

# One forward's inputs: a tensor, a tuple of positional arguments, or a dict of keyword arguments.
SampleInput = Union[torch.Tensor, tuple, Mapping]
FP32 = 4


def saved_tensor_bytes(model: torch.nn.Module, sample_input: SampleInput, precision: MixedPrecision) -> int:
    """Bytes autograd saves for backward in one forward of ``sample_input``
    in training mode, parameters and buffers aside (zcore keeps those).
    Runs on the meta device with meta copies of the parameters in the
    compute dtype (floating inputs too), so nothing is computed or allocated."""
    def meta(t: torch.Tensor, cast: bool) -> torch.Tensor:
        dtype = precision.compute_dtype if cast and t.is_floating_point() else t.dtype
        return torch.empty(t.shape, dtype=dtype, device="meta")

    params = {n: meta(p, True).requires_grad_(p.requires_grad) for n, p in model.named_parameters()}
    buffers = {n: meta(b, precision.cast_buffers) for n, b in model.named_buffers()}
    saved = SavedTensors(kept=(*params.values(), *buffers.values()))
    args, kwargs = _arguments(sample_input, lambda t: meta(t, True))
    modes = {m: m.training for m in model.modules()}
    try:
        model.train()
        with (
            torch.enable_grad(),
            torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack),
            FusedAttention(saved),
        ):
            torch.func.functional_call(model, {**params, **buffers}, args, kwargs)
    finally:
        for m, training in modes.items():
            m.training = training
    return saved.nbytes


class SavedTensors:
    """Saved-tensor hooks that count each saved storage once (a view
    counts its base), except the tensors in ``kept``."""

    def __init__(self, kept: tuple[torch.Tensor, ...]) -> None:
        self._kept = {id(t) for t in kept}
        self._bytes: dict[int, int] = {}  # id of a base tensor -> its bytes
        self._tensors: list[torch.Tensor] = []  # alive until counted, so ids stay unique
        self.paused = False
        self.extra = 0  # bytes saved by kernels whose tensors are not seen

    def add(self, t: torch.Tensor) -> None:
        base = t if t._base is None else t._base
        if id(t) not in self._kept and id(base) not in self._kept:
            self._bytes[id(base)] = base.numel() * base.element_size()
            self._tensors.append(base)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if not self.paused:
            self.add(t)
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    @property
    def nbytes(self) -> int:
        return sum(self._bytes.values()) + self.extra


class FusedAttention(torch.overrides.TorchFunctionMode):
    """scaled_dot_product_attention counted as torch's fused kernels (flash,
    memory-efficient) save it for backward: query, key, value, the output
    and an fp32 log-sum-exp per query row. On the meta device it runs
    unfused, which would count the whole attention matrix, several times."""

    def __init__(self, saved: SavedTensors) -> None:
        super().__init__()
        self._saved = saved

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        self._saved.paused = True
        try:
            out = func(*args, **kwargs)
        finally:
            self._saved.paused = False
        if out.requires_grad:
            query, key, value = (*args, *(kwargs.get(k) for k in ("query", "key", "value")))[:3]
            for t in (query, key, value, out):
                self._saved.add(t)
            self._saved.extra += query.shape[:-1].numel() * FP32
        return out


def _arguments(sample_input: SampleInput, convert: Any) -> tuple[tuple, dict]:
    def each(value: Any) -> Any:
        return convert(value) if isinstance(value, torch.Tensor) else value
    if isinstance(sample_input, Mapping):
        return (), {k: each(v) for k, v in sample_input.items()}
    if isinstance(sample_input, tuple):
        return tuple(each(v) for v in sample_input), {}
    return (each(sample_input),), {}
