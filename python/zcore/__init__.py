"""zcore: the memory engine for training PyTorch models larger than the GPU.

The native core (``zcore._C``) decides what lives where and moves bytes; this
package wires it into PyTorch.
"""

from zcore import _C
from zcore.arena import Arena, Block
from zcore.errors import (
    CudaError,
    CudaUnavailableError,
    HostMemoryBudgetError,
    InvalidArgumentError,
    InvalidHandleError,
    NativeOSError,
    OutOfArenaError,
    ZcoreError,
)
from zcore.host_memory import HostMemory
from zcore.runtime import build_info, cuda_available, cuda_unavailable_reason

__version__ = "0.1.0"

__all__ = [
    "Arena",
    "Block",
    "CudaError",
    "CudaUnavailableError",
    "HostMemory",
    "HostMemoryBudgetError",
    "InvalidArgumentError",
    "InvalidHandleError",
    "NativeOSError",
    "OutOfArenaError",
    "ZcoreError",
    "build_info",
    "cuda_available",
    "cuda_unavailable_reason",
]
