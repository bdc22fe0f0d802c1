"""The public API, listed: each public path exports exactly these names, each
imports from there, and each class and function names a public path as its
``__module__`` (where it is defined is internal). A name added to or removed
from the public API changes this list on purpose."""

from __future__ import annotations

import importlib
import inspect

import pytest

import zcore
import zcore.errors

PUBLIC = {
    "zcore": [
        "AioEngine", "Arena", "Block", "CheckpointCorruptError", "CheckpointError", "CheckpointMismatchError",
        "Config", "ConfigError", "CudaError", "CudaUnavailableError", "DiskFullError", "DiskIOError", "Engine",
        "FileTooSmallError", "GatheredParameters", "HostMemory", "HostMemoryBudgetError", "InvalidArgumentError",
        "InvalidHandleError", "InvalidStateError", "IoHandle", "MetaInit", "NativeOSError", "OutOfArenaError",
        "ShortReadError", "SwapCorruptedError", "SwapFileLostError", "SwapManager", "ZcoreError", "build_info",
        "cuda_available", "cuda_unavailable_reason", "estimate_memory", "get_z3_leaf_modules", "init_distributed", "initialize",
        "load_deepspeed_checkpoint", "load_pretrained", "recommend_config", "register_external_parameter", "save_pretrained",
        "set_z3_leaf_modules", "unregister_external_parameter", "unset_z3_leaf_modules", "z3_leaf_module",
    ],
    "zcore.zero": [
        "GatheredParameters", "Init", "get_z3_leaf_modules", "register_external_parameter", "set_z3_leaf_modules",
        "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix", "unregister_external_parameter",
        "unset_z3_leaf_modules", "unwrap_model_for_generation", "z3_leaf_module", "z3_leaf_parameter",
    ],
    "zcore.utils": [
        "RepeatingLoader", "get_z3_leaf_modules", "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
        "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
        "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
        "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state",
        "safe_update_full_grad_vectorized", "set_z3_leaf_modules", "set_z3_leaf_modules_by_name",
        "set_z3_leaf_modules_by_suffix", "unset_z3_leaf_modules", "z3_leaf_module", "z3_leaf_parameter",
    ],
    "zcore.utils.zero_to_fp32": [
        "convert_zero_checkpoint_to_fp32_state_dict", "get_fp32_state_dict_from_zero_checkpoint",
        "load_state_dict_from_zero_checkpoint",
    ],
    "zcore.checkpointing": ["checkpoint", "configure", "is_configured", "non_reentrant_checkpoint", "reset"],
    "zcore.config": ["Config", "load_config"],
    "zcore.checkpoint": ["consolidate", "full_state_dict", "load_checkpoint", "load_dcp", "save_checkpoint", "save_dcp"],
    "zcore.optim": [
        "AdamConfig", "CPUAdam", "CPUAdamW", "CompressedAdam", "GradCheck", "MatrixAndElementwise",
        "MatrixOptimizer", "Muon", "OneBitAdam", "ZeroOneAdam",
        "adam_step", "adam_step_flat", "cpu_isa", "set_cpu_isa", "supported_cpu_isas", "unscale_and_check",
    ],
    "zcore.trainer": ["ZcoreTrainer"],
    "zcore.lightning": ["ZcorePrecision", "ZcoreStrategy"],
    "zcore.pipelining": ["PipelineStage"],
    "zcore.comm_bench": ["Measurement", "at_peak_fraction", "measure", "report"],
}
# Public too, without an __all__ of their own: the exception types.
PUBLIC_MODULES = set(PUBLIC) | {"zcore.errors"}


@pytest.mark.parametrize("path", sorted(PUBLIC))
def test_public_path_exports_its_names(path):
    module = importlib.import_module(path)
    assert sorted(module.__all__) == sorted(PUBLIC[path])
    for name in PUBLIC[path]:
        assert hasattr(module, name), f"{path}.{name}"


@pytest.mark.parametrize("path", sorted(PUBLIC))
def test_public_objects_name_a_public_path(path):
    module = importlib.import_module(path)
    private = {
        f"{path}.{name}": obj.__module__
        for name in PUBLIC[path]
        if (inspect.isclass(obj := getattr(module, name)) or inspect.isfunction(obj))
        and obj.__module__ not in PUBLIC_MODULES
    }
    assert private == {}


@pytest.mark.parametrize("path", sorted(PUBLIC))
def test_the_named_module_holds_the_object(path):
    """Pickle and documentation tools find each object under its __module__."""
    module = importlib.import_module(path)
    for name in PUBLIC[path]:
        obj = getattr(module, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert getattr(importlib.import_module(obj.__module__), obj.__name__) is obj


def test_every_zcore_error_is_exported_from_the_package():
    errors = {
        name for name, obj in vars(zcore.errors).items()
        if inspect.isclass(obj) and issubclass(obj, zcore.ZcoreError)
    }
    assert errors <= set(zcore.__all__)
