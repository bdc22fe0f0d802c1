"""zcore: the memory engine for training PyTorch models larger than the GPU.

The native core (``zcore._C``) decides what lives where and moves bytes; this
package wires it into PyTorch.
"""

# torch before the native module: loaded first, zcore._C's CUDA runtime and
# CCCL symbols made torch 2.11+cu130's own import crash (GPU check, 2026-11-28).
import torch  # noqa: F401
import zcore._C  # noqa: F401 - the native module loads with the package
from zcore.memory.aio import AioEngine, IoHandle
from zcore.memory.arena import Arena, Block
from zcore.checkpoint.deepspeed_format import load_deepspeed_checkpoint
from zcore.checkpoint.pretrained import load_pretrained, save_pretrained
from zcore.config.schema import Config
from zcore.engine.engine import Engine
from zcore.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    ConfigError,
    CudaError,
    CudaUnavailableError,
    DiskFullError,
    DiskIOError,
    FileTooSmallError,
    SwapCorruptedError,
    SwapFileLostError,
    HostMemoryBudgetError,
    InvalidArgumentError,
    InvalidHandleError,
    InvalidStateError,
    NativeOSError,
    OutOfArenaError,
    ShortReadError,
    ZcoreError,
)
from zcore.plan.estimate import estimate_memory
from zcore.engine.gathered_parameters import (
    GatheredParameters,
    register_external_parameter,
    unregister_external_parameter,
)
from zcore.memory.host_memory import HostMemory
from zcore.engine.initialize import initialize
from zcore.comm.launch import init_distributed
from zcore.plan.recommend import recommend_config
from zcore.zero3.meta_init import MetaInit
from zcore.runtime import build_info, cuda_available, cuda_unavailable_reason
from zcore.memory.swap import SwapManager
from zcore.zero3.leaf_modules import get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module
import zcore.zero  # noqa: F401 - DeepSpeed's deepspeed.zero names, as zcore.zero
import zcore.utils  # noqa: F401 - DeepSpeed's deepspeed.utils names, as zcore.utils
import zcore.checkpointing  # noqa: F401 - DeepSpeed's deepspeed.checkpointing names

__version__ = "0.1.0"

__all__ = [
    "AioEngine",
    "Arena",
    "Block",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointMismatchError",
    "Config",
    "ConfigError",
    "CudaError",
    "CudaUnavailableError",
    "DiskFullError",
    "DiskIOError",
    "Engine",
    "FileTooSmallError",
    "SwapCorruptedError",
    "SwapFileLostError",
    "GatheredParameters",
    "HostMemory",
    "HostMemoryBudgetError",
    "InvalidArgumentError",
    "InvalidHandleError",
    "InvalidStateError",
    "IoHandle",
    "MetaInit",
    "NativeOSError",
    "OutOfArenaError",
    "ShortReadError",
    "SwapManager",
    "ZcoreError",
    "build_info",
    "cuda_available",
    "cuda_unavailable_reason",
    "estimate_memory",
    "get_z3_leaf_modules",
    "init_distributed",
    "initialize",
    "load_deepspeed_checkpoint",
    "load_pretrained",
    "recommend_config",
    "register_external_parameter",
    "save_pretrained",
    "set_z3_leaf_modules",
    "unregister_external_parameter",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
]

# Public objects name the path users import them from (as torch's FSDP2
# does); where they are defined is the package's own business. The errors
# keep zcore.errors, itself public.
for _name in __all__:
    if globals()[_name].__module__ != "zcore.errors":
        globals()[_name].__module__ = __name__
