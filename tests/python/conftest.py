"""Shared fixtures: the device the engine tests run on, and filesystems
made by the tests (they need root and mount; elsewhere the tests that use
them skip with the reason).

The device switch: ZCORE_TEST_DEVICE, read once here, is ``cpu`` (the
default) or ``cuda``. Tests marked ``device`` run their engines on it and
take it from the ``device`` fixture (a string, passed on to the ranks; the
rank side is tests/python/devices.py); with ``cuda`` where no GPU, NCCL or
zcore CUDA build can be used, they skip with the reason. The GPU check runs
``ZCORE_TEST_DEVICE=cuda pytest -m "device or cuda"`` (``cuda``: the kernel
tests, which need a GPU whatever the switch says)."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import pytest

DEVICES = ("cpu", "cuda")
TEST_DEVICE = os.environ.get("ZCORE_TEST_DEVICE", "").strip().lower() or "cpu"


@functools.cache
def unusable_reason(device: str) -> Optional[str]:
    """Why the engine tests cannot run on ``device`` here; None when they can.
    Asked only when a test marked ``device`` is about to run."""
    if device == "cpu":
        return None
    import torch
    import torch.distributed as dist

    import zcore

    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no usable CUDA GPU (torch.cuda.is_available() is False)"
    if not dist.is_nccl_available():
        return f"torch {torch.__version__} was built without NCCL"
    if not zcore.cuda_available():
        return f"zcore cannot use CUDA: {zcore.cuda_unavailable_reason()}"
    return None


def pytest_configure(config: pytest.Config) -> None:
    if TEST_DEVICE not in DEVICES:
        raise pytest.UsageError(f"ZCORE_TEST_DEVICE={TEST_DEVICE!r}: expected one of {', '.join(DEVICES)}")


def pytest_report_header(config: pytest.Config) -> str:
    return f"ZCORE_TEST_DEVICE: {TEST_DEVICE} (tests marked device run there)"


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("device") is not None:
        reason = unusable_reason(TEST_DEVICE)
        if reason is not None:
            pytest.skip(f"ZCORE_TEST_DEVICE={TEST_DEVICE}: {reason}")


@pytest.fixture
def device(request: pytest.FixtureRequest) -> str:
    """Where the test's engines run: ZCORE_TEST_DEVICE for a test marked
    ``device``, the CPU for the others (a parametrized test marks only the
    cases that can run on one GPU: world 1)."""
    return TEST_DEVICE if request.node.get_closest_marker("device") is not None else "cpu"


def _mounted(fstype: str, target: Path, options: str) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip(f"mounting a {fstype} filesystem needs root")
    if shutil.which("mount") is None:
        pytest.skip("no mount command on this machine")
    target.mkdir()
    done = subprocess.run(
        ["mount", "-t", fstype, "-o", options, fstype, str(target)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount {fstype} here: {done.stderr.strip()}")
    try:
        yield target
    finally:
        if os.path.ismount(target):  # a test may have unmounted it already
            subprocess.run(["umount", "-l", str(target)], check=True)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs: writes past that fail with ENOSPC."""
    yield from _mounted("tmpfs", tmp_path / "small", "size=2m")


@pytest.fixture
def small_ext4(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB ext4 filesystem on a loop device, with no blocks reserved
    for root: filled, it has 0 bytes free, and even a new directory fails
    with ENOSPC (tmpfs makes directories without blocks)."""
    if os.geteuid() != 0:
        pytest.skip("mounting an ext4 image needs root")
    if shutil.which("mkfs.ext4") is None or shutil.which("mount") is None:
        pytest.skip("no mkfs.ext4 or mount command on this machine")
    image = tmp_path / "ext4.img"
    with open(image, "wb") as f:
        f.truncate(8 * 2**20)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], capture_output=True, text=True, check=False)
    if made.returncode != 0:
        pytest.skip(f"cannot make an ext4 image here: {made.stderr.strip()}")
    target = tmp_path / "ext4"
    target.mkdir()
    done = subprocess.run(["mount", "-o", "loop", str(image), str(target)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount an ext4 image here (no loop device?): {done.stderr.strip()}")
    try:
        yield target
    finally:
        if os.path.ismount(target):
            subprocess.run(["umount", "-l", str(target)], check=True)


@pytest.fixture
def nvme_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs: room for the tiny GPT's two swap files, and easy to fill."""
    yield from _mounted("tmpfs", tmp_path / "nvme", "size=8m")


@pytest.fixture
def ramfs_dir(tmp_path: Path) -> Iterator[Path]:
    """A ramfs, which refuses O_DIRECT (unlike tmpfs since Linux 6.6)."""
    yield from _mounted("ramfs", tmp_path / "ramfs", "mode=755")


@pytest.fixture
def unwritable_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory this process cannot create files in.

    Root ignores permission bits, so as root it is a read-only mount (EROFS);
    otherwise a directory with mode 0555 (EACCES).
    """
    if os.geteuid() == 0:
        yield from _mounted("tmpfs", tmp_path / "readonly", "ro,size=1m")
        return
    target = tmp_path / "readonly"
    target.mkdir()
    target.chmod(0o555)
    try:
        yield target
    finally:
        target.chmod(0o755)
