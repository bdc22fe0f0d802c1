"""Shared fixtures: filesystems made by the tests (they need root and mount;
elsewhere the tests that use them skip with the reason)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


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
