"""Fused optimizer kernels: Adam/AdamW steps and the gradient check; and
DeepSpeed's communication-compressing Adams.

- :class:`CPUAdam` / :class:`CPUAdamW`: drop-in torch optimizers for CPU
  parameters.
- :class:`Muon`: torch.optim.Muon's update as a :class:`MatrixOptimizer`,
  the interface of optimizers whose update needs each whole matrix, which
  ZeRO runs by owner compute; :class:`MatrixAndElementwise` pairs one with
  an element-wise optimizer for the other parameters.
- :class:`OneBitAdam` / :class:`ZeroOneAdam`: 1-bit Adam and 0/1 Adam,
  which average over the ranks themselves, in 1-bit messages, on the steps
  where ``takes_averaged_gradients()`` is False (ZeRO stage 0).
- :func:`adam_step` / :func:`adam_step_flat`: the flat-buffer step (fp32
  master and states, fp32/bf16/fp16 gradients, optional bf16/fp16 copy-out)
  on CPU or CUDA tensors, used by the offload path.
- :func:`unscale_and_check`: unscale, inf/nan detection and squared norm.
- :func:`cpu_isa` / :func:`set_cpu_isa` / :func:`supported_cpu_isas`: the
  SIMD level chosen at run time (or forced with ``ZCORE_CPU_ISA``).
"""

from zcore.optim.adam import CPUAdam, CPUAdamW
from zcore.optim.compressed_adam import CompressedAdam
from zcore.optim.functional import (
    AdamConfig,
    GradCheck,
    adam_step,
    adam_step_flat,
    cpu_isa,
    set_cpu_isa,
    supported_cpu_isas,
    unscale_and_check,
)
from zcore.optim.matrix_optimizer import MatrixAndElementwise, MatrixOptimizer
from zcore.optim.muon import Muon
from zcore.optim.onebit_adam import OneBitAdam
from zcore.optim.zero_one_adam import ZeroOneAdam

__all__ = [
    "AdamConfig",
    "CPUAdam",
    "CPUAdamW",
    "CompressedAdam",
    "GradCheck",
    "MatrixAndElementwise",
    "MatrixOptimizer",
    "Muon",
    "OneBitAdam",
    "ZeroOneAdam",
    "adam_step",
    "adam_step_flat",
    "cpu_isa",
    "set_cpu_isa",
    "supported_cpu_isas",
    "unscale_and_check",
]

for _name in __all__:
    globals()[_name].__module__ = __name__
