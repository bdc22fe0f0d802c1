"""zcore.checkpoint.direct_file: bytes appended in pieces of any size land
in the file exactly, through whole aligned O_DIRECT writes."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import zcore
from zcore.memory.aio import AioEngine
from zcore.memory.staging import PAGE
from zcore.checkpoint.direct_file import CHUNK, DEPTH, DirectAppender


def pieces(rng: np.random.Generator, total: int) -> list[bytes]:
    """Random bytes cut at random sizes: tiny, page-straddling and larger than a chunk."""
    data = rng.integers(0, 256, total, dtype=np.uint8).tobytes()
    cuts = sorted(set(rng.integers(1, total, 40).tolist()) | {3, PAGE + 5, CHUNK + 7})
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, total])]


def test_appended_pieces_equal_the_file(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    total = (DEPTH + 1) * CHUNK + 12345  # every staging buffer is reused; a partial last page
    parts = pieces(rng, total)
    path = tmp_path / "out.bin"
    path.touch()
    engine = AioEngine(tmp_path)
    appender = DirectAppender(engine, path)
    for part in parts:
        appender.append(memoryview(part))
    appender.finish()
    assert path.read_bytes() == b"".join(parts)
    stats = engine.stats()
    assert stats.bytes_written == total
    if engine.backend == "libaio":
        # Whole pages straight from the aligned buffers; only the last partial page is cached.
        assert stats.bounce_bytes == 0
        assert stats.page_cache_bytes == total % PAGE


def test_a_full_filesystem_raises_disk_full(small_fs: Path) -> None:
    path = small_fs / "big.bin"
    path.touch()
    appender = DirectAppender(AioEngine(small_fs), path)
    with pytest.raises(zcore.DiskFullError):
        appender.append(memoryview(os.urandom(4 << 20)))  # more than the 2 MiB filesystem
        appender.finish()
    appender.wait_all()  # nothing left in flight
