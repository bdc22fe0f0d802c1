"""Checks that tensors can be handed to the native kernels as raw pointers,
for the optimizer kernels and zcore.comm.quantization alike.

Every check runs before any kernel starts, so a bad call raises
:class:`zcore.InvalidArgumentError` with nothing written.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import zcore._C as _C
from zcore.errors import InvalidArgumentError

NATIVE_DTYPES = {
    torch.float32: _C.DType.FLOAT32,
    torch.bfloat16: _C.DType.BFLOAT16,
    torch.float16: _C.DType.FLOAT16,
}
FP32 = (torch.float32,)
# Master weights and optimizer states: fp32, or bf16 (DeepSpeed's
# bf16_master_weights_and_grads and bf16_optimizer_states).
MASTER_DTYPES = (torch.float32, torch.bfloat16)
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
COPY_OUT_DTYPES = (torch.bfloat16, torch.float16)


def dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    """``dtypes`` for an error message: ``"torch.float32, torch.bfloat16"``."""
    return ", ".join(str(d) for d in dtypes)


def check_tensor(
    tensor: object,
    name: str,
    dtypes: Sequence[torch.dtype],
    device: torch.device,
    numel: int | None = None,
) -> torch.Tensor:
    """``tensor`` if it is a dense, contiguous, aligned tensor of an accepted
    dtype on ``device`` (with ``numel`` elements when given); else raises."""
    if not isinstance(tensor, torch.Tensor):
        raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}", name=name)
    if tensor.layout != torch.strided:
        raise InvalidArgumentError(
            f"{name} has layout={tensor.layout}; only dense tensors are supported", name=name
        )
    if tensor.dtype not in dtypes:
        raise InvalidArgumentError(
            f"{name} has dtype={tensor.dtype}; expected one of: {dtype_names(dtypes)}",
            name=name,
            dtype=str(tensor.dtype),
        )
    if tensor.device != device:
        raise InvalidArgumentError(
            f"{name} is on device={tensor.device} but the call runs on {device}; move it there",
            name=name,
            device=str(tensor.device),
        )
    if not tensor.is_contiguous():
        raise InvalidArgumentError(
            f"{name} is not contiguous (shape={tuple(tensor.shape)}, stride={tensor.stride()}); "
            "pass .contiguous() buffers",
            name=name,
        )
    if numel is not None and tensor.numel() != numel:
        raise InvalidArgumentError(
            f"{name} has {tensor.numel()} elements (shape={tuple(tensor.shape)}) but {numel} are needed",
            name=name,
            numel=tensor.numel(),
            expected=numel,
        )
    if tensor.numel() > 0 and tensor.data_ptr() % tensor.element_size() != 0:
        raise InvalidArgumentError(
            f"{name} at address {tensor.data_ptr():#x} is not aligned to its element size "
            f"{tensor.element_size()}",
            name=name,
        )
    return tensor


def kernel_device(tensor: object, name: str) -> torch.device:
    """The device of ``tensor``, where a call that takes it runs: it must be a
    tensor on cpu or cuda."""
    if not isinstance(tensor, torch.Tensor):
        raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}", name=name)
    if tensor.device.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(
            f"{name} is on device={tensor.device}; zcore's kernels run on cpu and cuda",
            name=name,
            device=str(tensor.device),
        )
    return tensor.device


def step_device(tensors: Sequence[torch.Tensor], name: str) -> torch.device:
    """The device of the first tensor, which every other one must share."""
    if len(tensors) == 0:
        raise InvalidArgumentError(f"{name} is empty; pass at least one tensor", name=name)
    return kernel_device(tensors[0], f"{name}[0]")


def check_lengths(expected: int, **lists: Sequence[torch.Tensor] | None) -> None:
    """Every given list has ``expected`` entries."""
    for name, values in lists.items():
        if values is not None and len(values) != expected:
            raise InvalidArgumentError(
                f"{name} has {len(values)} tensors but params has {expected}; pass one per parameter",
                name=name,
            )
