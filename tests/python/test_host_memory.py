"""Host memory owned by zcore, seen by torch without copies."""

import gc

import pytest
import torch

import zcore
from zcore import _C


def test_zeros_shares_native_memory_and_is_aligned():
    mem = zcore.HostMemory(1 << 20)
    t = mem.zeros((16, 32), torch.float32)
    assert t.shape == (16, 32) and t.dtype == torch.float32 and torch.all(t == 0)
    assert t.data_ptr() % 4096 == 0
    buf = mem.buffer(256, alignment=64)
    view = torch.frombuffer(buf, dtype=torch.uint8)
    view.fill_(7)
    assert view.data_ptr() == buf.address
    assert bytes(memoryview(buf))[:4] == b"\x07\x07\x07\x07"


def test_budget_is_enforced_and_refunded_when_tensors_die():
    mem = zcore.HostMemory(8192)
    t = mem.zeros((1024,), torch.float32)  # 4 KiB
    assert mem.stats().used == 4096
    with pytest.raises(zcore.HostMemoryBudgetError, match="budget exceeded") as info:
        mem.zeros((2048,), torch.float32)
    assert (info.value.requested, info.value.available, info.value.budget) == (8192, 4096, 8192)
    view = t[10:20]
    del t
    gc.collect()
    assert mem.stats().used == 4096  # a view still holds the buffer
    del view
    gc.collect()
    assert mem.stats().used == 0
    assert mem.zeros((2048,), torch.float32).numel() == 2048


def test_arena_draws_from_a_shared_budget():
    mem = zcore.HostMemory(1 << 16)
    first = zcore.Arena.on_host(1 << 15, memory=mem)
    with pytest.raises(zcore.HostMemoryBudgetError):
        zcore.Arena.on_host(1 << 16, memory=mem)
    del first
    gc.collect()
    assert zcore.Arena.on_host(1 << 16, memory=mem).capacity == 1 << 16


def test_try_lock_reports_what_it_locked():
    mem = zcore.HostMemory(1 << 16, lock="try")
    buf = mem.buffer(4096)
    assert buf.locked  # 4 KiB is within any RLIMIT_MEMLOCK
    assert mem.stats().locked == 4096


def test_bad_arguments():
    with pytest.raises(zcore.InvalidArgumentError, match="lock must be one of"):
        zcore.HostMemory(1024, lock="always")
    with pytest.raises(zcore.InvalidArgumentError, match="positive"):
        zcore.HostMemory(-1)
    mem = zcore.HostMemory(1 << 16)
    with pytest.raises(zcore.InvalidArgumentError, match="no elements"):
        mem.zeros((0, 4), torch.float32)
    with pytest.raises(zcore.InvalidArgumentError, match="power of two"):
        mem.buffer(64, alignment=24)
    assert mem.stats().used == 0
    assert isinstance(mem.buffer(64), _C.HostBuffer)
