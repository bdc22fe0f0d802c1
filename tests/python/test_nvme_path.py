"""nvme_path (zero_optimization.offload_optimizer and offload_param) is
created where missing, with its parents, as DeepSpeed's swappers do
(os.makedirs(exist_ok=True) in runtime/swap_tensor), by every rank at once.
A path that cannot be created (a file in the way, no permission, a
read-only filesystem) is a DiskIOError at zcore.initialize naming the
config key, the path and the OS's reason."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest

import zcore
from distributed import run_ranks
from models import make_model
from zcore.config.policies import SwapSpace
from training import zcore_config

OPTIMIZER_KEY = "zero_optimization.offload_optimizer.nvme_path"
PARAM_KEY = "zero_optimization.offload_param.nvme_path"


def space(path: Path) -> SwapSpace:
    return SwapSpace(str(path), OPTIMIZER_KEY, block_size=1 << 20, queue_depth=8, threads=1)


def nvme_config(path: str) -> dict:
    nvme = {"device": "nvme", "nvme_path": path}
    zero = {"stage3_param_persistence_threshold": 0, "sub_group_size": 1000,
            "offload_param": {**nvme, "max_in_cpu": 0}, "offload_optimizer": nvme}
    return zcore_config(3, 1, 0.0, zero=zero)


def test_a_missing_nvme_path_is_created_with_its_parents(tmp_path: Path) -> None:
    path = tmp_path / "scratch" / "job" / "swap"
    with space(path).open("optimizer", 1 << 20, 1 << 20) as swap:
        assert path.is_dir() and Path(swap.path).parent == path
    assert list(path.iterdir()) == []


def test_threads_creating_the_same_nvme_path_at_once_all_succeed(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "c"
    count = 8
    start = threading.Barrier(count)
    opened, failed = [], []

    def open_one() -> None:
        start.wait()
        try:
            opened.append(space(path).open("optimizer", 1 << 20, 1 << 20))
        except Exception as exc:  # collected: the assertion below shows it
            failed.append(exc)

    threads = [threading.Thread(target=open_one) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert failed == [] and len({swap.path for swap in opened}) == count
    finally:
        for swap in opened:
            swap.close()


def initialize_and_list(rank: int, world: int, path: str) -> list[str]:
    engine, _, _, _ = zcore.initialize(model=make_model("gpt"), config=nvme_config(path))
    names = sorted(os.listdir(path))
    engine.destroy()
    return names


def test_every_rank_creates_a_missing_nvme_path_at_initialize(tmp_path: Path) -> None:
    path = tmp_path / "not" / "yet" / "there"
    names = run_ranks(initialize_and_list, 2, str(path), timeout=240)
    for rank, seen in enumerate(names):  # each rank's own swap files went there
        assert any(f"-params-rank{rank}-" in n for n in seen) and any(f"-optimizer-rank{rank}-" in n for n in seen), seen
    assert path.is_dir() and os.listdir(path) == []  # destroy() removed every swap file


def blocked_paths(tmp_path: Path) -> list[tuple[str, Path, Path, int]]:
    """(case, nvme_path, what is in the way, the errno)."""
    file = tmp_path / "a_file"
    file.write_text("not a directory")
    return [
        ("a file at the path", file, file, errno.EEXIST),
        ("a file as a parent", file / "swap" / "here", file, errno.ENOTDIR),
    ]


@pytest.mark.parametrize("case", ["a file at the path", "a file as a parent"])
def test_a_path_with_a_file_in_the_way_is_refused_naming_the_key_path_and_reason(tmp_path: Path, case: str) -> None:
    _, path, in_the_way, code = next(c for c in blocked_paths(tmp_path) if c[0] == case)
    with pytest.raises(zcore.DiskIOError) as info:
        space(path).open("optimizer", 1 << 20, 1 << 20)
    message = str(info.value)
    assert message.startswith(f"{OPTIMIZER_KEY} = {str(path)!r} is not a directory and cannot be created: "), message
    assert os.strerror(code) in message and f"{str(in_the_way)!r} exists and is not a directory" in message
    assert info.value.errno == code and info.value.path == str(path)
    assert in_the_way.read_text() == "not a directory"


def test_a_path_in_a_directory_without_write_permission_is_refused(unwritable_dir: Path) -> None:
    path = unwritable_dir / "swap"
    with pytest.raises(zcore.DiskIOError) as info:
        space(path).open("optimizer", 1 << 20, 1 << 20)
    assert info.value.errno in (errno.EACCES, errno.EROFS)
    assert str(info.value).startswith(f"{OPTIMIZER_KEY} = {str(path)!r} is not a directory and cannot be created")
    assert os.strerror(info.value.errno) in str(info.value)
    assert not path.exists()


def initialize_outcome(rank: int, world: int, path: str) -> dict:
    try:
        zcore.initialize(model=make_model("gpt"), config=nvme_config(path))
    except zcore.ZcoreError as exc:
        return {"error": type(exc).__name__, "message": str(exc), "errno": exc.details.get("errno")}
    return {"error": None}


def test_initialize_refuses_an_nvme_path_that_cannot_be_created(tmp_path: Path) -> None:
    _, path, _, code = blocked_paths(tmp_path)[1]
    (out,) = run_ranks(initialize_outcome, 1, str(path), launcher=False, timeout=120)
    assert out["error"] == "DiskIOError" and out["errno"] == code, out
    # Parameters are placed first: their key is the one named.
    assert out["message"].startswith(f"{PARAM_KEY} = {str(path)!r}"), out
    assert os.strerror(code) in out["message"]
