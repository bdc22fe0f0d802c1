"""zcore.memory.swap: tensors out to the swap file and back byte for byte, the
pipelined stream, reuse of swap space, the checks made before training, and
sharing a directory (one file per manager, leftovers of killed runs removed)."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest
import torch

import zcore
from zcore import _C


def make_tensors() -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        0: torch.randn(1000, generator=g),
        1: torch.randn(33, 77, generator=g).to(torch.bfloat16),
        2: torch.randint(-100, 100, (5,), generator=g, dtype=torch.int8),
        3: torch.randn(1 << 18, generator=g),
    }


@pytest.mark.parametrize("backend", ["auto", "threadpool"])
def test_round_trip_keeps_shape_dtype_and_bytes(tmp_path: Path, backend: str) -> None:
    tensors = make_tensors()
    with zcore.SwapManager(tmp_path, 16 << 20, rank=0, backend=backend, block_size=64 << 10) as swap:
        for key, t in tensors.items():
            swap.swap_out(key, t)
        swap.wait_all()
        assert all(swap.state(k) == _C.SwapState.ON_DISK for k in tensors)
        back = {key: swap.swap_in(key) for key in tensors}
        swap.wait_all()
        for key, t in tensors.items():
            assert back[key].dtype == t.dtype and back[key].shape == t.shape
            assert torch.equal(back[key], t)
        out = torch.empty_like(tensors[3])
        assert swap.swap_in(3, out=out) is out
        swap.wait(3)
        assert torch.equal(out, tensors[3])


def test_stream_reads_ahead_and_writes_back(tmp_path: Path) -> None:
    originals = {k: torch.full((100_000,), float(k)) for k in range(6)}
    with zcore.SwapManager(tmp_path, 8 << 20, rank=0, host_budget=4 << 20) as swap:
        for key, t in originals.items():
            swap.swap_out(key, t)
        swap.wait_all()
        seen = []
        for key, tensor in swap.stream(list(originals)):
            seen.append(key)
            assert torch.equal(tensor, originals[key])
            # The next key is already being read while this one is in use.
            if key + 1 in originals:
                assert swap.state(key + 1) in (_C.SwapState.READING, _C.SwapState.ON_DISK)
            tensor += 1
        assert seen == list(originals)
        for key, tensor in swap.stream(list(originals), write_back=False):
            assert torch.equal(tensor, originals[key] + 1)
        # At most three tensors (400 KB each) were in host memory at once.
        assert swap._pool.stats().held <= 3 * 4096 * 98


def test_released_space_is_reused(tmp_path: Path) -> None:
    with zcore.SwapManager(tmp_path, 1 << 20, rank=0) as swap:
        a = torch.ones(100_000, dtype=torch.uint8)
        swap.swap_out(1, a)
        swap.swap_out(2, a)
        swap.wait_all()
        used = swap.stats().used
        with pytest.raises(zcore.DiskFullError):
            swap.swap_out(3, torch.ones(1 << 20, dtype=torch.uint8))
        swap.release(1)
        assert swap.stats().used < used
        swap.swap_out(3, a)
        swap.wait(3)
        assert 1 not in swap and 3 in swap
        back = swap.swap_in(2)
        swap.wait(2)
        assert torch.equal(back, a)


def test_close_removes_the_swap_file(tmp_path: Path) -> None:
    swap = zcore.SwapManager(tmp_path, 1 << 20, rank=5)
    assert Path(swap.path).exists() and "rank5" in swap.path
    swap.swap_out(0, torch.ones(10))
    swap.close()
    assert list(tmp_path.iterdir()) == []


def test_refuses_a_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(zcore.DiskIOError) as info:
        zcore.SwapManager(tmp_path / "absent", 1 << 20)
    assert info.value.errno == errno.ENOENT


def test_refuses_a_filesystem_without_room_for_the_plan(tmp_path: Path) -> None:
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    with pytest.raises(zcore.DiskFullError) as info:
        zcore.SwapManager(tmp_path, free + (1 << 40))
    assert info.value.required == free + (1 << 40)
    assert info.value.available <= free + (1 << 30)
    assert list(tmp_path.iterdir()) == []


def test_refuses_an_unwritable_directory(unwritable_dir: Path) -> None:
    with pytest.raises(zcore.DiskIOError) as info:
        zcore.SwapManager(unwritable_dir, 1 << 10)
    assert info.value.errno in (errno.EACCES, errno.EROFS)


def test_disk_filling_up_fails_that_swap_only(small_fs: Path) -> None:
    with zcore.SwapManager(small_fs, 1 << 20, rank=0) as swap:
        kept = torch.arange(100_000, dtype=torch.int32)
        swap.swap_out(0, kept)
        swap.wait(0)
        (small_fs / "filler").write_bytes(b"\0" * ((2 << 20) - (400 << 10)))
        swap.swap_out(1, torch.ones(500_000, dtype=torch.uint8))
        with pytest.raises(zcore.DiskFullError) as info:
            swap.wait(1)
        assert info.value.errno == errno.ENOSPC
        assert 1 not in swap
        back = swap.swap_in(0)
        swap.wait(0)
        assert torch.equal(back, kept)


def test_host_budget_is_enforced(tmp_path: Path) -> None:
    with zcore.SwapManager(tmp_path, 8 << 20, rank=0, host_budget=1 << 20) as swap:
        swap.swap_out(0, torch.ones(1 << 20, dtype=torch.uint8))
        swap.swap_out(1, torch.ones(1 << 19, dtype=torch.uint8))
        swap.wait_all()
        held = swap.swap_in(1)
        with pytest.raises(zcore.HostMemoryBudgetError):
            swap.swap_in(0)
        swap.wait(1)
        assert held.sum().item() == 1 << 19


@pytest.mark.cuda
def test_cuda_tensors_swap_through_staging(tmp_path: Path) -> None:
    if not zcore.cuda_available():
        pytest.skip(f"no usable GPU: {zcore.cuda_unavailable_reason()}")
    with zcore.SwapManager(tmp_path, 64 << 20, rank=0) as swap:
        t = torch.randn(3, 1_000_001, device="cuda")
        swap.swap_out(7, t)
        swap.wait(7)
        back = swap.swap_in(7)
        swap.wait(7)
        assert back.device == t.device and torch.equal(back, t)


@pytest.mark.parametrize("backend", ["auto", "threadpool"])
def test_a_deleted_swap_file_is_lost_not_read_back_as_zeros(tmp_path: Path, backend: str) -> None:
    """A tmp cleaner deletes the file; the next swap-out used to recreate it,
    and swap_in of an older key then returned zeros."""
    swap = zcore.SwapManager(tmp_path, 1 << 20, rank=0, backend=backend)
    swap.swap_out(1, torch.arange(1000, dtype=torch.float32))
    swap.wait(1)
    os.unlink(swap.path)
    with pytest.raises(zcore.SwapFileLostError, match="was deleted"):
        swap.swap_out(2, torch.ones(1000))
    assert not os.path.exists(swap.path)
    with pytest.raises(zcore.SwapFileLostError) as lost:
        swap.swap_in(1)
    assert lost.value.path == swap.path
    swap.close()


@pytest.mark.parametrize("backend", ["auto", "threadpool"])
def test_a_replaced_swap_file_is_lost_and_kept(tmp_path: Path, backend: str) -> None:
    swap = zcore.SwapManager(tmp_path, 1 << 20, rank=0, backend=backend)
    swap.swap_out(1, torch.arange(2048, dtype=torch.float32))
    swap.wait(1)
    size = os.path.getsize(swap.path)
    other = tmp_path / "other"
    other.write_bytes(b"\0" * size)
    os.replace(other, swap.path)
    with pytest.raises(zcore.SwapFileLostError, match="replaced by another file") as lost:
        swap.swap_in(1)
    assert lost.value.found_inode == os.stat(swap.path).st_ino != lost.value.inode
    swap.close()
    assert os.path.getsize(swap.path) == size  # someone else's file: left alone


@pytest.mark.parametrize("backend", ["auto", "threadpool"])
def test_bytes_changed_in_place_are_corrupted_not_returned(tmp_path: Path, backend: str) -> None:
    """Same file, same inode, one byte changed under the manager: the swap-in
    is refused by its checksum instead of handing back the wrong value."""
    swap = zcore.SwapManager(tmp_path, 1 << 20, rank=0, backend=backend)
    original = torch.arange(4096, dtype=torch.float32)
    swap.swap_out(1, original)
    swap.wait(1)
    offset = swap.extent(1).offset
    with open(swap.path, "r+b") as f:
        f.seek(offset + 4 * 1234)
        f.write(b"\x01")
    swap.swap_in(1)
    with pytest.raises(zcore.SwapCorruptedError, match="differ from the bytes swapped out") as bad:
        swap.wait(1)
    assert (bad.value.id, bad.value.path, bad.value.offset) == (1, swap.path, offset)
    swap.swap_out(1, original)
    swap.wait(1)
    back = swap.swap_in(1)
    swap.wait(1)
    assert torch.equal(back, original)
    swap.close()


def test_managers_of_one_rank_have_distinct_files_by_name(tmp_path: Path) -> None:
    names = ["params", "optimizer", "params", ""]
    managers = [zcore.SwapManager(tmp_path, 1 << 20, rank=0, name=n) for n in names]
    try:
        assert len({m.path for m in managers}) == len(managers)
        assert Path(managers[0].path).name.startswith("zcore-swap-params-rank0-")
        assert Path(managers[1].path).name.startswith("zcore-swap-optimizer-rank0-")
        assert Path(managers[3].path).name.startswith("zcore-swap-rank0-")
        for i, m in enumerate(managers):
            assert m.leftovers_removed == []
            m.swap_out(0, torch.full((1000,), float(i)))
        for i, m in enumerate(managers):
            m.wait(0)
            back = m.swap_in(0)
            m.wait(0)
            assert torch.equal(back, torch.full((1000,), float(i)))
    finally:
        for m in managers:
            m.close()
    assert list(tmp_path.iterdir()) == []


def test_refuses_a_name_that_is_not_a_file_name_part(tmp_path: Path) -> None:
    with pytest.raises(zcore.InvalidArgumentError, match="swap name 'opt-1'"):
        zcore.SwapManager(tmp_path, 1 << 20, name="opt-1")
    assert list(tmp_path.iterdir()) == []


def test_leftover_of_a_killed_run_is_removed_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    leftover = tmp_path / "zcore-swap-optimizer-rank0-otherhost-4242-0123456789abcdef.swp"
    leftover.write_bytes(b"\0" * 3000)
    kept = tmp_path / "zcore-swap-notes.txt"
    kept.write_text("not a swap file")
    with caplog.at_level(logging.WARNING, logger="zcore"):
        with zcore.SwapManager(tmp_path, 1 << 20, rank=0, name="optimizer") as swap:
            assert swap.leftovers_removed == [str(leftover)]
            assert swap.stats().leftover_bytes_removed == 3000
            # The live file of `swap` is no leftover for the next manager.
            with zcore.SwapManager(tmp_path, 1 << 20, rank=0, name="optimizer") as other:
                assert other.leftovers_removed == []
    assert not leftover.exists() and kept.exists()
    records = [r for r in caplog.records if r.name == "zcore"]
    assert len(records) == 1
    message = records[0].getMessage()
    assert "removed 1 leftover" in message and "3000 bytes" in message and str(tmp_path) in message


def test_space_of_removed_leftovers_counts_as_free(
    small_fs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A killed run's file filled most of the 2 MiB filesystem: the next run
    removes it before checking for room, rather than refusing to start."""
    leftover = small_fs / "zcore-swap-rank0-otherhost-4242-0123456789abcdef.swp"
    leftover.write_bytes(b"\1" * (1536 << 10))
    with caplog.at_level(logging.WARNING, logger="zcore"):
        with zcore.SwapManager(small_fs, 1 << 20, rank=0) as swap:
            assert swap.leftovers_removed == [str(leftover)]
    assert "removed 1 leftover" in caplog.text
