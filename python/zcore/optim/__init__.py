"""Fused optimizer kernels: Adam/AdamW steps and the gradient check.

- :class:`CPUAdam` / :class:`CPUAdamW`: drop-in torch optimizers for CPU
  parameters.
- :func:`adam_step` / :func:`adam_step_flat`: the flat-buffer step (fp32
  master and states, fp32/bf16/fp16 gradients, optional bf16/fp16 copy-out)
  on CPU or CUDA tensors, used by the offload path.
- :func:`unscale_and_check`: unscale, inf/nan detection and squared norm.
- :func:`cpu_isa` / :func:`set_cpu_isa` / :func:`supported_cpu_isas`: the
  SIMD level chosen at run time (or forced with ``ZCORE_CPU_ISA``).
"""

from zcore.optim.adam import CPUAdam, CPUAdamW
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

__all__ = [
    "AdamConfig",
    "CPUAdam",
    "CPUAdamW",
    "GradCheck",
    "adam_step",
    "adam_step_flat",
    "cpu_isa",
    "set_cpu_isa",
    "supported_cpu_isas",
    "unscale_and_check",
]
