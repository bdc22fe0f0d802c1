"""Checks an installed zcore wheel: imports before torch, and works."""

import sys

import zcore

assert "site-packages" in zcore.__file__, f"zcore imported from {zcore.__file__}, not the wheel"
import torch  # noqa: E402

info = zcore.build_info()
arena = zcore.Arena.on_host(1 << 20)
block = arena.allocate((64, 64), torch.float32)
arena.tensor(block).fill_(1.5)
assert float(arena.tensor(block).sum()) == 1.5 * 64 * 64
try:
    arena.free(block)
    arena.free(block)
except zcore.InvalidHandleError:
    pass
else:
    sys.exit("double free was not refused")
if not zcore.cuda_available():
    try:
        zcore.Arena.on_device(1 << 20)
    except zcore.CudaUnavailableError:
        pass
    else:
        sys.exit("a device arena without CUDA was not refused")
print(f"wheel OK: {info}")
