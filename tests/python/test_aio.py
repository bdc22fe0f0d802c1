"""zcore.memory.aio against an independent reference (plain Python file I/O), on both
engines, with sizes, offsets and buffers that are aligned and ones that are not,
and the documented exception on each fault path."""

from __future__ import annotations

import errno
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import zcore
from zcore import _C

BLOCK = 64 << 10

BACKENDS = [
    pytest.param(
        "libaio",
        marks=pytest.mark.skipif(
            not _C.libaio_compiled(), reason="zcore was built without libaio (THREADPOOL)"
        ),
    ),
    "threadpool",
]


@pytest.fixture(params=BACKENDS)
def engine(request: pytest.FixtureRequest) -> zcore.AioEngine:
    return zcore.AioEngine(block_size=BLOCK, queue_depth=8, threads=2, backend=request.param)


def random_bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def host_tensor(n: int, shift: int) -> torch.Tensor:
    """n bytes starting `shift` bytes past a page boundary (0: O_DIRECT-aligned)."""
    memory = zcore.HostMemory(n + shift + 4096)
    return memory.zeros((n + shift,), torch.uint8)[shift:]


def file_bytes(path: Path, offset: int, n: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(n)


def test_reports_the_engine_in_use(engine: zcore.AioEngine) -> None:
    assert engine.backend in ("libaio", "threadpool")
    assert engine.backend_reason


@pytest.mark.parametrize("size", [1, BLOCK - 1, BLOCK, BLOCK + 1, 4097, (3 << 20) + 5])
@pytest.mark.parametrize("shift", [0, 1, 4000])
def test_round_trip_byte_for_byte(
    engine: zcore.AioEngine, tmp_path: Path, size: int, shift: int
) -> None:
    rng = random.Random(size * 31 + shift)
    offset = rng.choice([0, 4096 * rng.randint(1, 8), rng.randint(1, 1 << 20)])
    path = tmp_path / "data.bin"
    before = os.urandom(offset + size + 3000)
    path.write_bytes(before)
    data = random_bytes(size, seed=size + shift)
    src = host_tensor(size, shift)
    src.copy_(data)

    engine.pwrite(src, path, offset).wait()
    expected = before[:offset] + data.numpy().tobytes() + before[offset + size :]
    assert path.read_bytes() == expected

    dst = host_tensor(size, shift)
    handle = engine.pread(dst, path, offset)
    assert handle.wait() is dst
    assert torch.equal(dst, data)


def test_typed_tensors_and_plain_torch_allocations(engine: zcore.AioEngine, tmp_path: Path) -> None:
    path = tmp_path / "typed.bin"
    tensors = [torch.randn(1001), torch.randn(7, 129).to(torch.bfloat16), torch.arange(5, dtype=torch.int64)]
    offset = 0
    handles = []
    for t in tensors:
        handles.append((engine.pwrite(t, path, offset), offset, t))
        offset += t.numel() * t.element_size() + 3
    for h, off, t in handles:
        h.wait()
        assert file_bytes(path, off, t.numel() * t.element_size()) == t.view(-1).view(torch.uint8).numpy().tobytes()
        back = torch.empty_like(t)
        engine.pread(back, path, off).wait()
        assert torch.equal(back, t)


def test_many_concurrent_requests(engine: zcore.AioEngine, tmp_path: Path) -> None:
    rng = random.Random(5)
    path = tmp_path / "many.bin"
    sizes = [rng.randint(1, 3 * BLOCK) for _ in range(128)]
    total = sum(sizes)
    data = random_bytes(total, seed=9)
    src = host_tensor(total, 0)
    src.copy_(data)
    offset = 0
    for n in sizes:
        engine.pwrite(src[offset : offset + n], path, offset)
        offset += n
    assert engine.pending == len(sizes)
    engine.wait_all()
    assert engine.pending == 0
    assert path.read_bytes() == data.numpy().tobytes()

    dst = host_tensor(total, 0)
    offset = 0
    handles = []
    for n in sizes:
        handles.append(engine.pread(dst[offset : offset + n], path, offset))
        offset += n
    engine.wait_all()
    assert all(h.poll() for h in handles)
    assert torch.equal(dst, data)


def test_aligned_tensors_take_the_direct_path(tmp_path: Path) -> None:
    if not _C.libaio_compiled():
        pytest.skip("zcore was built without libaio (THREADPOOL)")
    engine = zcore.AioEngine(tmp_path, block_size=BLOCK, backend="auto")
    if engine.backend != "libaio":
        pytest.skip(f"O_DIRECT is not usable in {tmp_path}: {engine.backend_reason}")
    t = host_tensor(1 << 20, 0)
    engine.pwrite(t, tmp_path / "a.bin", 8192).wait()
    engine.pread(t, tmp_path / "a.bin", 8192).wait()
    stats = engine.stats()
    assert (stats.bytes_written, stats.bytes_read) == (1 << 20, 1 << 20)
    assert stats.bounce_bytes == 0 and stats.page_cache_bytes == 0


def test_handles_poll_and_cannot_be_waited_twice(engine: zcore.AioEngine, tmp_path: Path) -> None:
    h = engine.pwrite(torch.ones(1 << 18), tmp_path / "p.bin")
    while not h.poll():
        pass
    h.wait()
    with pytest.raises(zcore.InvalidHandleError):
        h.wait()


def test_bad_tensors_are_refused(engine: zcore.AioEngine, tmp_path: Path) -> None:
    with pytest.raises(zcore.InvalidArgumentError, match="contiguous"):
        engine.pwrite(torch.ones(4, 4).t(), tmp_path / "x.bin")
    with pytest.raises(zcore.InvalidArgumentError, match="at least one element"):
        engine.pread(torch.ones(0), tmp_path / "x.bin")
    with pytest.raises(zcore.InvalidArgumentError, match="block_size"):
        zcore.AioEngine(block_size=1000)


def test_read_past_the_end_is_file_too_small(engine: zcore.AioEngine, tmp_path: Path) -> None:
    path = tmp_path / "small.bin"
    path.write_bytes(b"x" * 1000)
    with pytest.raises(zcore.FileTooSmallError) as info:
        engine.pread(torch.empty(1001, dtype=torch.uint8), path)
    assert info.value.path == str(path) and info.value.file_size == 1000
    assert isinstance(info.value, OSError)


def test_missing_file_names_path_and_errno(engine: zcore.AioEngine, tmp_path: Path) -> None:
    with pytest.raises(zcore.DiskIOError) as info:
        engine.pread(torch.empty(10), tmp_path / "absent.bin")
    assert info.value.errno == errno.ENOENT
    assert "absent.bin" in str(info.value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_truncated_under_a_pending_read_is_a_short_read(backend: str, tmp_path: Path) -> None:
    # One small block in flight at a time, from disk, so the read takes long
    # enough for the truncation to land while it is pending.
    slow = zcore.AioEngine(block_size=4096, queue_depth=1, threads=1, backend=backend)
    path = tmp_path / "trunc.bin"
    n = 48 << 20
    path.write_bytes(b"\xab" * n)
    fd = os.open(path, os.O_RDONLY)
    os.fdatasync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # read from disk: slow enough
    os.close(fd)
    handle = slow.pread(host_tensor(n, 0), path)
    os.truncate(path, 1 << 20)
    with pytest.raises(zcore.ShortReadError) as info:
        handle.wait()
    assert info.value.path == str(path)


def test_filling_the_filesystem_is_disk_full_and_keeps_earlier_bytes(
    engine: zcore.AioEngine, small_fs: Path
) -> None:
    path = small_fs / "fill.bin"
    first = random_bytes(1 << 20, seed=1)
    engine.pwrite(first, path).wait()
    with pytest.raises(zcore.DiskFullError) as info:
        engine.pwrite(random_bytes(4 << 20, seed=2), path, 1 << 20).wait()
    assert info.value.errno == errno.ENOSPC
    assert info.value.path == str(path)
    back = torch.empty(1 << 20, dtype=torch.uint8)
    engine.pread(back, path).wait()
    assert torch.equal(back, first)


@pytest.mark.parametrize("backend", BACKENDS)
def test_file_size_limit_is_disk_full(backend: str, tmp_path: Path) -> None:
    """RLIMIT_FSIZE (works without root): the write past it fails with EFBIG."""
    path = tmp_path / "limited.bin"
    script = textwrap.dedent(
        f"""
        import resource, signal, torch, zcore
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        engine = zcore.AioEngine(block_size=65536, backend={backend!r})
        engine.pwrite(torch.full((1 << 19,), 7, dtype=torch.uint8), {str(path)!r}).wait()
        try:
            engine.pwrite(torch.full((1 << 20,), 9, dtype=torch.uint8), {str(path)!r}, 1 << 19).wait()
        except zcore.DiskFullError as exc:
            print("errno", exc.errno)
        else:
            print("write reported success")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == f"errno {errno.EFBIG}", done.stdout + done.stderr
    assert file_bytes(path, 0, 1 << 19) == b"\x07" * (1 << 19)


def test_unwritable_directory_is_a_disk_io_error(engine: zcore.AioEngine, unwritable_dir: Path) -> None:
    with pytest.raises(zcore.DiskIOError) as info:
        engine.pwrite(torch.ones(10), unwritable_dir / "x.bin")
    assert info.value.errno in (errno.EACCES, errno.EROFS)
    assert str(unwritable_dir) in str(info.value)


def test_falls_back_where_o_direct_is_refused(ramfs_dir: Path) -> None:
    engine = zcore.AioEngine(ramfs_dir, block_size=BLOCK)
    assert engine.backend == "threadpool"
    assert "O_DIRECT" in engine.backend_reason
    data = random_bytes(100_001, seed=3)
    engine.pwrite(data, ramfs_dir / "f.bin", 17).wait()
    back = torch.empty_like(data)
    engine.pread(back, ramfs_dir / "f.bin", 17).wait()
    assert torch.equal(back, data)


def test_libaio_engine_serves_files_that_refuse_o_direct(ramfs_dir: Path) -> None:
    if not _C.libaio_compiled():
        pytest.skip("zcore was built without libaio (THREADPOOL)")
    engine = zcore.AioEngine(block_size=BLOCK, backend="libaio")
    data = random_bytes(300_000, seed=4)
    engine.pwrite(data, ramfs_dir / "g.bin").wait()
    back = torch.empty_like(data)
    engine.pread(back, ramfs_dir / "g.bin").wait()
    assert torch.equal(back, data)
    assert engine.stats().page_cache_bytes == 600_000


@pytest.mark.cuda
def test_cuda_tensors_round_trip_through_host_staging(tmp_path: Path) -> None:
    if not zcore.cuda_available():
        pytest.skip(f"no usable GPU: {zcore.cuda_unavailable_reason()}")
    engine = zcore.AioEngine(tmp_path, block_size=BLOCK)
    t = torch.randn(1_000_003, device="cuda")
    engine.pwrite(t, tmp_path / "cuda.bin", 5).wait()
    assert file_bytes(tmp_path / "cuda.bin", 5, t.numel() * 4) == t.cpu().numpy().tobytes()
    back = torch.empty_like(t)
    engine.pread(back, tmp_path / "cuda.bin", 5).wait()
    assert torch.equal(back, t)


# A regression here aborted the process (heap corruption) or hung it, so each
# case runs in its own interpreter with a timeout.
REFUSAL_SCRIPT = textwrap.dedent("""
    import os, sys, torch, zcore
    backend, path, offset = sys.argv[1], sys.argv[2], int(sys.argv[3])
    engine = zcore.AioEngine(backend=backend)
    for call in (engine.pwrite, engine.pread):
        try:
            call(torch.zeros(4096, dtype=torch.uint8), path, offset).wait()
        except zcore.InvalidArgumentError as e:
            print("refused:", e)
        else:
            print("accepted")
""")


def run_refusal(backend: str, path: Path, offset: int) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", REFUSAL_SCRIPT, backend, str(path), str(offset)],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.splitlines()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("offset", [2**63 - 16, 2**63 - 4096, 2**63 - 1])
def test_offsets_ending_past_the_largest_file_offset_are_refused(backend, offset, tmp_path):
    lines = run_refusal(backend, tmp_path / "far", offset)
    assert len(lines) == 2 and all("largest file offset" in line for line in lines), lines
    assert not (tmp_path / "far").exists()


@pytest.mark.parametrize("offset", [2**63, 2**64 + 5, -1, True, 1.5])
def test_offsets_outside_int64_are_invalid_arguments(engine, offset, tmp_path):
    for call in (engine.pwrite, engine.pread):
        with pytest.raises(zcore.InvalidArgumentError, match="offset must be an int"):
            call(torch.zeros(16, dtype=torch.uint8), tmp_path / "f", offset)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_fifo_is_refused_instead_of_blocking(backend, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    lines = run_refusal(backend, fifo, 0)
    assert len(lines) == 2 and all(f"{fifo} is a FIFO" in line for line in lines), lines


@pytest.mark.parametrize("path", ["/dev/zero", "DIR"])
def test_devices_and_directories_are_refused(engine, path, tmp_path):
    target = tmp_path if path == "DIR" else Path(path)
    for call in (engine.pwrite, engine.pread):
        with pytest.raises(zcore.InvalidArgumentError, match="regular files only"):
            call(torch.zeros(16, dtype=torch.uint8), target, 0).wait()
