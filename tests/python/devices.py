"""The rank side of the device switch (ZCORE_TEST_DEVICE, read in
conftest.py, which hands tests the device as a string: "cpu" or "cuda").

zcore has no device setting: ``zcore.comm.init_distributed`` joins the
default process group if one exists, else makes one on NCCL whenever torch
sees a GPU (the device is then ``cuda:LOCAL_RANK``), on gloo otherwise (the
CPU). So a rank that must run on the CPU of a GPU machine makes the group
on gloo first; everything else is left to zcore, which then makes the
group as a user's script would see it made.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
BACKENDS = {"cpu": "gloo", "cuda": "nccl"}


def init_process_group(device: str) -> torch.device:
    """Before ``zcore.initialize`` on a rank whose engines run on ``device``:
    returns the torch device zcore will pick (checked by the caller, or by
    ``assert_on``); raises when this process already has a default group
    of the other backend (an engine on the CPU and one on the GPU cannot
    share a process)."""
    backend = BACKENDS[device]
    if dist.is_initialized():
        if dist.get_backend() != backend:
            raise RuntimeError(
                f"this process's default group is on {dist.get_backend()}; engines on {device} need "
                f"{backend}: run the tests marked device by themselves (-m device)"
            )
    elif device == "cpu" and torch.cuda.is_available():
        if all(v in os.environ for v in _LAUNCHER_VARS):
            dist.init_process_group(backend="gloo", init_method="env://")
        else:
            dist.init_process_group(backend="gloo", store=dist.HashStore(), rank=0, world_size=1)
    if device == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def assert_on(engine, device: str) -> None:
    """The engine runs where the test asked: NCCL and this rank's GPU for cuda, gloo and the CPU for cpu."""
    context = engine.context
    assert (context.device.type, context.backend) == (device, BACKENDS[device]), (
        f"the engine runs on {context.device} over {context.backend}, the test asked for {device}"
    )


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory_allocated(device: torch.device) -> int:
    """Bytes of live tensors on a CUDA device (the caching allocator's count,
    each allocation rounded up to 512 bytes), after its queued work."""
    synchronize(device)
    return torch.cuda.memory_allocated(device)


@contextmanager
def side_stream(device: torch.device) -> Iterator[None]:
    """Work queued within runs on a new CUDA stream, which first waits for
    the current one, and the current one waits for it after (as a user's
    forward on a side stream must before backward); on the CPU, which has
    no streams, nothing changes."""
    if device.type != "cuda":
        yield
        return
    current = torch.cuda.current_stream(device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        yield
    current.wait_stream(stream)


# A CUDA build of torch on a machine without a driver (PyPI's torch on a CPU
# machine) fails at its first CUDA call, even a profiler's setup or a faked
# torch.cuda.is_available: tests that pretend to have a GPU skip there.
CUDA_BUILD_WITHOUT_DRIVER = torch.version.cuda is not None and not torch.cuda.is_available()
skip_on_cuda_build_without_driver = pytest.mark.skipif(
    CUDA_BUILD_WITHOUT_DRIVER, reason="torch is a CUDA build and this machine has no CUDA driver"
)
