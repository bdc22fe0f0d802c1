"""Flat-buffer entry points of the fused optimizer kernels.

These are what the ZeRO offload path calls on its fp32 master shards: one
Adam/AdamW step over a list of buffers (or one flat buffer), optionally
writing the updated parameters to a bf16/fp16 buffer in the same pass, and
the gradient check that precedes a step (unscale, inf/nan, squared norm).
CPU tensors run on the native CPU kernels with ``num_threads`` threads
(default ``torch.get_num_threads()``); CUDA tensors run one multi-tensor
launch on the current stream of their device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

import zcore._C as _C
from zcore.errors import InvalidArgumentError
from zcore.memory.kernel_tensors import (
    COPY_OUT_DTYPES,
    GRAD_DTYPES,
    MASTER_DTYPES,
    NATIVE_DTYPES,
    check_lengths,
    check_tensor,
    step_device,
)


@dataclass(frozen=True)
class AdamConfig:
    """Hyper-parameters of Adam (``decoupled_weight_decay=False``: L2 added to
    the gradient) or AdamW (``True``), with torch.optim's meaning and checks."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled_weight_decay: bool = False
    maximize: bool = False

    def __post_init__(self) -> None:
        beta1, beta2 = self.betas
        checks = (
            (0.0 <= self.lr, f"Invalid learning rate: {self.lr}"),
            (0.0 <= self.eps, f"Invalid epsilon value: {self.eps}"),
            (0.0 <= beta1 < 1.0, f"Invalid beta parameter at index 0: {beta1}"),
            (0.0 <= beta2 < 1.0, f"Invalid beta parameter at index 1: {beta2}"),
            (0.0 <= self.weight_decay, f"Invalid weight_decay value: {self.weight_decay}"),
        )
        for ok, message in checks:
            if not ok:
                raise InvalidArgumentError(message)

    def native(self, step: int, grad_scale: float) -> _C.AdamOptions:
        if step < 1:
            raise InvalidArgumentError(f"step={step} must be >= 1 (steps taken, this one included)", step=step)
        options = _C.AdamOptions()
        options.lr = float(self.lr)
        options.beta1, options.beta2 = (float(b) for b in self.betas)
        options.eps = float(self.eps)
        options.weight_decay = float(self.weight_decay)
        options.decoupled_weight_decay = self.decoupled_weight_decay
        options.step = int(step)
        # maximize: torch negates the gradient first; a negative scale is the same.
        options.grad_scale = -float(grad_scale) if self.maximize else float(grad_scale)
        return options


def adam_step(
    config: AdamConfig,
    step: int,
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    params_out: Sequence[torch.Tensor] | None = None,
    grad_scale: float = 1.0,
    num_threads: int | None = None,
) -> None:
    """One Adam/AdamW step, in place, over every parameter of the lists.

    ``params``: fp32 or bf16; ``exp_avgs``, ``exp_avg_sqs``: fp32 or bf16, the
    same dtype for every moment of a tensor (bf16 values are upcast, stepped
    in fp32 and rounded to nearest even once). ``grads``: fp32, bf16 or
    fp16, multiplied by ``grad_scale`` (1/loss_scale times the clipping
    coefficient) before use. ``params_out``: optional bf16/fp16 tensors that
    receive the updated parameters, rounded to nearest even. ``step`` counts
    steps taken, this one included (torch's ``state["step"]`` after ``+= 1``).
    """
    device = step_device(params, "params")
    check_lengths(len(params), grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs, params_out=params_out)
    options = config.native(step, grad_scale)
    tensors = []
    for i, p in enumerate(params):
        check_tensor(p, f"params[{i}]", MASTER_DTYPES, device)
        n = p.numel()
        g = check_tensor(grads[i], f"grads[{i}]", GRAD_DTYPES, device, n)
        m = check_tensor(exp_avgs[i], f"exp_avgs[{i}]", MASTER_DTYPES, device, n)
        v = check_tensor(exp_avg_sqs[i], f"exp_avg_sqs[{i}]", (m.dtype,), device, n)
        out_ptr, out_dtype = 0, _C.DType.BFLOAT16
        if params_out is not None:
            out = check_tensor(params_out[i], f"params_out[{i}]", COPY_OUT_DTYPES, device, n)
            out_ptr, out_dtype = out.data_ptr(), NATIVE_DTYPES[out.dtype]
        tensors.append(
            _C.AdamTensor(
                p.data_ptr(), g.data_ptr(), NATIVE_DTYPES[g.dtype], m.data_ptr(), v.data_ptr(), n,
                out_ptr, out_dtype, NATIVE_DTYPES[p.dtype], NATIVE_DTYPES[m.dtype],
            )
        )
    if device.type == "cpu":
        _C.adam_step(options, tensors, _threads(num_threads))
    else:
        with torch.cuda.device(device):
            _C.cuda_adam_step(options, tensors, torch.cuda.current_stream(device).cuda_stream)


def adam_step_flat(
    config: AdamConfig,
    step: int,
    params: torch.Tensor,
    grads: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    params_out: torch.Tensor | None = None,
    grad_scale: float = 1.0,
    num_threads: int | None = None,
) -> None:
    """:func:`adam_step` over one flat buffer of each kind."""
    adam_step(
        config, step, [params], [grads], [exp_avg], [exp_avg_sq],
        params_out=None if params_out is None else [params_out],
        grad_scale=grad_scale, num_threads=num_threads,
    )


@dataclass(frozen=True)
class GradCheck:
    """What :func:`unscale_and_check` found."""

    nonfinite: bool                    # some scaled element is inf or nan
    sum_sq: float                      # sum of squares over all buffers, accumulated in float64
    buffer_sum_sq: tuple[float, ...]   # the same per buffer

    @property
    def norm(self) -> float:
        """The L2 norm of all scaled gradients (inf or nan when ``nonfinite``)."""
        return math.sqrt(self.sum_sq)


def unscale_and_check(
    grads: Sequence[torch.Tensor],
    scale: float = 1.0,
    *,
    write_back: bool = True,
    num_threads: int | None = None,
) -> GradCheck:
    """Multiplies every gradient by ``scale`` (1/loss_scale), detects inf/nan
    and sums the squares of the scaled values in float64, in one pass.

    With ``write_back`` the scaled values replace the gradients (rounded to
    nearest even for bf16/fp16); ``scale == 1`` writes nothing.
    """
    device = step_device(grads, "grads")
    buffers = []
    for i, g in enumerate(grads):
        check_tensor(g, f"grads[{i}]", GRAD_DTYPES, device)
        buffers.append(_C.GradBuffer(g.data_ptr(), NATIVE_DTYPES[g.dtype], g.numel()))
    if device.type == "cpu":
        stats = _C.unscale_and_check(buffers, float(scale), write_back, _threads(num_threads))
    else:
        with torch.cuda.device(device):
            stream = torch.cuda.current_stream(device).cuda_stream
            stats = _C.cuda_unscale_and_check(buffers, float(scale), write_back, stream)
    return GradCheck(stats.nonfinite, stats.sum_sq, tuple(stats.buffer_sum_sq))


def _threads(num_threads: int | None) -> int:
    return torch.get_num_threads() if num_threads is None else int(num_threads)


def cpu_isa() -> str:
    """The SIMD level the CPU kernels use: ``scalar``, ``avx2`` or ``avx512``."""
    return _C.cpu_isa_name(_C.active_cpu_isa())


def supported_cpu_isas() -> list[str]:
    """The levels this build and CPU can run, lowest first."""
    levels = (_C.CpuIsa.SCALAR, _C.CpuIsa.AVX2, _C.CpuIsa.AVX512)
    return [_C.cpu_isa_name(isa) for isa in levels if _C.cpu_isa_supported(isa)]


def set_cpu_isa(name: str) -> None:
    """Forces a SIMD level (see :func:`supported_cpu_isas`) for later calls."""
    _C.set_cpu_isa(_C.parse_cpu_isa(name))
