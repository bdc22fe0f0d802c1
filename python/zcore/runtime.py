"""What this build of zcore can do on this machine."""

from __future__ import annotations

from importlib import metadata

import zcore._C as _C


def cuda_available() -> bool:
    """True when zcore's CUDA entry points can run here.

    False when zcore was built without CUDA, or there is no driver or GPU;
    :func:`cuda_unavailable_reason` then says which.
    """
    return _C.cuda_device_count() > 0


def cuda_unavailable_reason() -> str:
    """Why CUDA cannot be used here, or ``""`` when it can."""
    return _C.cuda_unavailable_reason()


def build_info() -> dict[str, object]:
    """The version and the options the native core was built with."""
    return {
        "version": metadata.version("zcore"),
        "cuda_built": _C.cuda_built(),
        "cuda_devices": _C.cuda_device_count(),
        "io_backend": _C.io_backend(),
        "compiler": _C.compiler(),
    }
