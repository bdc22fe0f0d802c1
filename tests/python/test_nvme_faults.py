"""ZeRO-Infinity when the disk misbehaves, on filesystems the tests mount
(root only; elsewhere they skip with the reason), never the root disk beyond
a temporary directory. Every mount is detached at the end, also when a test
fails or unmounts it itself.

- A full disk during a swap-out is a DiskFullError naming the swap file, the
  bytes the write needs and the bytes free; the engine then refuses to go on
  (and to save), destroy() still removes its swap files, and files outside
  the swap files are untouched. At the swap manager: a failed swap-out
  forgets its key, and a swap-in of that key raises the same failure again
  (not "not swapped out"); a failed swap-in keeps its key.
- A directory that refuses O_DIRECT (ramfs) trains bit for bit like a
  directory on disk, with one INFO line per swap file saying its I/O goes
  through the page cache.
- A read-only nvme_path, or one that cannot be created (a file in the
  way; a missing one is created: test_nvme_path.py), is a DiskIOError at
  zcore.initialize naming the config key, the path and the cause; swap
  files that vanish mid-run (deleted, or the filesystem unmounted) are a
  SwapFileLostError at the next step or forward (or backward, for the
  gradients' file), after which the engine refuses to go on and to save,
  until a checkpoint is loaded into it.
- Lifetime: a relative nvme_path stays where it was at initialize when the
  script changes directory; an engine dropped without destroy() takes its
  swap files with it once collected; a destroyed engine says so when used.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import logging
import os
import subprocess
from pathlib import Path

import pytest
import torch

import zcore
from distributed import run_ranks
from log_capture import capture_zcore_log
from models import global_batch, loss_of, make_model
from training import zcore_config

MODEL = "gpt"
SWAP_PREFIX = "zcore-swap-"
PAGE_CACHE = "goes through the page cache"
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


# Training, inside a rank process.
def nvme_config(path: str, params: bool = True, optimizer: bool = True) -> dict:
    nvme = {"device": "nvme", "nvme_path": path}
    zero = {"stage3_param_persistence_threshold": 0, "sub_group_size": 1000}
    if params:
        zero["offload_param"] = {**nvme, "max_in_cpu": 0}  # every shard on NVMe
    if optimizer:
        zero["offload_optimizer"] = nvme
    return zcore_config(3, 1, 0.0, zero=zero)


def forward_backward(engine, step: int) -> float:
    x, y = global_batch(MODEL, step, engine.train_batch_size())
    loss = loss_of(MODEL, engine(x), y)
    engine.backward(loss)
    return loss.item()


def train(engine, steps: int) -> list[float]:
    losses = []
    for step in range(steps):
        losses.append(forward_backward(engine, step))
        engine.step()
    return losses


def outcome(call) -> dict:
    """What ``call()`` raised (class name, message, details), or None: picklable."""
    try:
        call()
    except zcore.ZcoreError as exc:
        return {"error": type(exc).__name__, "message": str(exc), "details": exc.details}
    return {"error": None}


def swap_files(directory: str) -> list[str]:
    return sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.startswith(SWAP_PREFIX))


def fill_up(path: str) -> None:
    """Writes to ``path`` until its filesystem is full."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for chunk in (1 << 16, 1 << 12):
            try:
                while True:
                    os.write(fd, b"\0" * chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
    finally:
        os.close(fd)


def punch_holes(path: str) -> None:
    """Frees the blocks of ``path`` (its size stays): writing there again
    needs new blocks, as every overwrite does on a copy-on-write filesystem."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fd = os.open(path, os.O_RDWR)
    try:
        if libc.fallocate(fd, FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE, 0, os.fstat(fd).st_size) != 0:
            raise OSError(ctypes.get_errno(), f"fallocate(PUNCH_HOLE) of {path}")
    finally:
        os.close(fd)


def digests(root: Path) -> dict[str, str]:
    files = [p for p in root.rglob("*") if p.is_file()]
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


# 1. A full disk.
def full_disk_mid_step(rank, world, nvme: str, elsewhere: str) -> dict:
    engine, _, _, _ = zcore.initialize(model=make_model(MODEL), config=nvme_config(nvme))
    train(engine, 1)
    forward_backward(engine, 1)
    # The swap files were written whole at initialize, so on tmpfs (as on
    # ext4) later swap-outs overwrite blocks they own and a disk filling up
    # cannot fail them. Freeing the parameter file's blocks makes its next
    # writes need new ones, as on a copy-on-write filesystem (btrfs, ZFS);
    # the step rewrites every shard before anything reads one.
    (params,) = [p for p in swap_files(nvme) if "-params-" in p]
    punch_holes(params)
    fill_up(os.path.join(nvme, "filler"))
    out = {"params_file": params, "step": outcome(engine.step)}
    out["forward"] = outcome(lambda: forward_backward(engine, 2))
    out["save"] = outcome(lambda: engine.save_checkpoint(os.path.join(elsewhere, "checkpoints"), tag="after"))
    engine.destroy()
    out["left"] = sorted(os.listdir(nvme))
    return out


def test_disk_full_during_a_swap_out_names_the_bytes_and_the_engine_refuses_to_go_on(
    nvme_tmpfs: Path, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "checkpoints" / "global_step1").mkdir(parents=True)
    (elsewhere / "checkpoints" / "latest").write_text("global_step1")
    (elsewhere / "checkpoints" / "global_step1" / "state.bin").write_bytes(os.urandom(1 << 16))
    (nvme_tmpfs / "notes.txt").write_text("the user's, beside the swap files")
    before = digests(elsewhere), digests(nvme_tmpfs)

    out = run_ranks(full_disk_mid_step, 1, str(nvme_tmpfs), str(elsewhere), launcher=False, timeout=120)[0]

    step = out["step"]
    assert step["error"] == "DiskFullError", step
    details, message = step["details"], step["message"]
    assert details["path"] == out["params_file"] and details["errno"] == errno.ENOSPC
    required, available = details["required"], details["available"]
    assert 0 <= available < required
    assert out["params_file"] in message
    assert f"needs {required} bytes" in message and f"{available} bytes free" in message
    for refused in (out["forward"], out["save"]):
        assert refused["error"] == "InvalidStateError", refused
        assert "cannot continue" in refused["message"] and "DiskFullError" in refused["message"]
    # destroy() removed both swap files and nothing else.
    assert out["left"] == ["filler", "notes.txt"]
    assert digests(elsewhere) == before[0]
    assert digests(nvme_tmpfs)["notes.txt"] == before[1]["notes.txt"]


def test_a_failed_swap_out_is_raised_again_by_a_swap_in_of_its_key(nvme_tmpfs: Path) -> None:
    with zcore.SwapManager(nvme_tmpfs, 1 << 20, rank=0) as swap:
        kept = torch.arange(1 << 14, dtype=torch.int32)
        swap.swap_out(0, kept)
        swap.wait(0)
        fill_up(str(nvme_tmpfs / "filler"))
        swap.swap_out(1, torch.ones(1 << 18, dtype=torch.uint8))
        with pytest.raises(zcore.DiskFullError) as failed:
            swap.wait(1)
        assert failed.value.path == swap.path and failed.value.required == 1 << 18
        assert 1 not in swap
        with pytest.raises(zcore.DiskFullError, match="key 1 cannot be swapped in: its swap-out failed") as again:
            swap.swap_in(1)
        assert again.value.key == 1 and again.value.path == swap.path
        # Other keys are unaffected, and overwriting one in place needs no new blocks.
        swap.swap_out(0, kept)
        swap.wait(0)
        back = swap.swap_in(0)
        swap.wait(0)
        assert torch.equal(back, kept)
        # With room again, the key can be swapped out anew.
        os.remove(nvme_tmpfs / "filler")
        fresh = torch.full((1 << 18,), 9, dtype=torch.uint8)
        swap.swap_out(1, fresh)
        swap.wait(1)
        back = swap.swap_in(1)
        swap.wait(1)
        assert torch.equal(back, fresh)


def test_a_failed_swap_in_keeps_its_key(tmp_path: Path) -> None:
    with zcore.SwapManager(tmp_path, 1 << 20, rank=0) as swap:
        values = torch.arange(1 << 14, dtype=torch.float32)
        swap.swap_out(0, values)
        swap.wait(0)
        os.truncate(swap.path, 4096)  # the same file, shorter
        for _ in range(2):  # the same error each time, never "not swapped out"
            with pytest.raises(zcore.FileTooSmallError) as info:
                swap.swap_in(0)
            assert info.value.path == swap.path
        assert 0 in swap and swap.state(0) == zcore._C.SwapState.ON_DISK
        swap.swap_out(0, values)  # written again: readable again
        swap.wait(0)
        back = swap.swap_in(0)
        swap.wait(0)
        assert torch.equal(back, values)


# 2. A directory without O_DIRECT.
def train_in_each(rank, world, directories: list[str], steps: int) -> list[dict]:
    out = []
    for directory in directories:
        messages = capture_zcore_log()
        try:
            engine, _, _, _ = zcore.initialize(model=make_model(MODEL), config=nvme_config(directory))
            losses = train(engine, steps)
            files = swap_files(directory)
            swaps = (engine.residency._store._swap, engine.optimizer.master.swap)
            backends = {swap.backend for swap in swaps}
            traffic = [swap.stats().bytes_swapped_in for swap in swaps]
            with zcore.GatheredParameters(list(engine.module.parameters())):
                params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
            engine.destroy()
        finally:
            logging.getLogger("zcore").removeHandler(messages)
        out.append({"losses": losses, "params": params, "files": files, "backends": backends,
                    "traffic": traffic, "messages": messages.messages})
    return out


def test_a_directory_without_o_direct_trains_bit_for_bit_saying_so_once_per_swap_file(
    ramfs_dir: Path, tmp_path: Path
) -> None:
    if not zcore._C.direct_io_unsupported_reason(str(ramfs_dir)):
        pytest.skip(f"{ramfs_dir} takes O_DIRECT on this kernel")
    on_disk = tmp_path / "disk"
    on_disk.mkdir()
    ram, disk = run_ranks(train_in_each, 1, [str(ramfs_dir), str(on_disk)], 4, launcher=False, timeout=120)[0]

    assert ram["backends"] == {"threadpool"}
    assert all(read > 0 for read in ram["traffic"])  # shards and states went through the files
    assert ram["losses"] == disk["losses"]
    assert ram["params"].keys() == disk["params"].keys()
    for name, value in ram["params"].items():
        assert torch.equal(value, disk["params"][name]), name
    said = [m for m in ram["messages"] if PAGE_CACHE in m]
    # Parameters, optimizer states, gradients: once per swap file, not once per I/O.
    assert len(ram["files"]) == 3 and len(said) == 3, said
    for path in ram["files"]:
        assert sum(path in m for m in said) == 1, (path, said)
    if "threadpool" not in disk["backends"]:
        assert not [m for m in disk["messages"] if PAGE_CACHE in m]


# 3. A directory that cannot be used, or that vanishes.
def initialize_each(rank, world, configs: list[dict]) -> list[dict]:
    return [outcome(lambda: zcore.initialize(model=make_model(MODEL), config=c)) for c in configs]


def unusable(path: str) -> list[tuple[str, dict]]:
    """(the config key of nvme_path, a config putting only that state on ``path``)."""
    return [
        ("zero_optimization.offload_param.nvme_path", nvme_config(path, params=True, optimizer=False)),
        ("zero_optimization.offload_optimizer.nvme_path", nvme_config(path, params=False, optimizer=True)),
    ]


def uncreatable(tmp_path: Path) -> Path:
    """A path that cannot be created: a file is in the way."""
    (tmp_path / "a_file").write_text("")
    return tmp_path / "a_file" / "swap"


def test_a_read_only_or_uncreatable_nvme_path_is_refused_at_initialize(unwritable_dir: Path, tmp_path: Path) -> None:
    missing = uncreatable(tmp_path)
    cases = [(unwritable_dir, (errno.EROFS, errno.EACCES)), (missing, (errno.ENOTDIR,))]
    configs = [config for path, _ in cases for _, config in unusable(str(path))]
    outcomes = iter(run_ranks(initialize_each, 1, configs, launcher=False, timeout=120)[0])
    for path, causes in cases:
        for key, _ in unusable(str(path)):
            out = next(outcomes)
            assert out["error"] == "DiskIOError", (key, out)
            assert out["details"]["errno"] in causes, (key, out)
            assert str(path) in out["message"] and os.strerror(out["details"]["errno"]) in out["message"], out
    assert not missing.exists() and os.listdir(unwritable_dir) == []


def test_an_unusable_nvme_path_is_refused_naming_its_config_key(tmp_path: Path) -> None:
    missing = str(uncreatable(tmp_path))
    outcomes = run_ranks(initialize_each, 1, [c for _, c in unusable(missing)], launcher=False, timeout=120)[0]
    for (key, _), out in zip(unusable(missing), outcomes):
        assert out["error"] == "DiskIOError", out
        assert key in out["message"], (key, out["message"])


def optimizer_file_vanishes(rank, world, nvme: str) -> dict:
    engine, _, _, _ = zcore.initialize(model=make_model(MODEL), config=nvme_config(nvme, params=False))
    train(engine, 1)
    engine.optimizer.finish_step()  # the file goes between steps, not under the one behind the forward
    (lost,) = [path for path in swap_files(nvme) if "-optimizer-" in os.path.basename(path)]
    os.remove(lost)
    forward_backward(engine, 1)  # the parameters are in memory: only the step needs the file
    out = {"lost": lost, "step": outcome(engine.step)}
    out["next"] = outcome(lambda: forward_backward(engine, 2))
    out["after"] = outcome(lambda: forward_backward(engine, 3))
    engine.destroy()
    out["left"] = os.listdir(nvme)
    return out


def test_a_vanished_optimizer_swap_file_is_lost_at_the_next_forward(nvme_tmpfs: Path) -> None:
    """The parameters are in host memory, so the step streams the
    sub-groups behind the next forward (zcore.step.background_step): the loss
    surfaces when that forward is done."""
    out = run_ranks(optimizer_file_vanishes, 1, str(nvme_tmpfs), launcher=False, timeout=120)[0]
    assert out["step"]["error"] is None, out["step"]
    assert out["next"]["error"] == "SwapFileLostError", out["next"]
    assert out["next"]["details"]["path"] == out["lost"] and out["lost"] in out["next"]["message"]
    assert out["after"]["error"] == "InvalidStateError" and "cannot continue" in out["after"]["message"]
    assert out["left"] == []


def swap_directory_vanishes(rank, world, nvme: str, how: str) -> dict:
    engine, _, _, _ = zcore.initialize(model=make_model(MODEL), config=nvme_config(nvme))
    train(engine, 1)
    files = swap_files(nvme)
    if how == "rm -rf":
        for path in files:
            os.remove(path)
    else:
        subprocess.run(["umount", "-l", nvme], check=True)
    out = {"files": files, "next": outcome(lambda: forward_backward(engine, 1))}
    out["after"] = outcome(lambda: forward_backward(engine, 2))
    out["destroy"] = outcome(engine.destroy)
    return out


@pytest.mark.parametrize("how", ["rm -rf", "umount"])
def test_a_vanished_swap_directory_is_lost_at_the_next_forward(nvme_tmpfs: Path, how: str) -> None:
    out = run_ranks(swap_directory_vanishes, 1, str(nvme_tmpfs), how, launcher=False, timeout=120)[0]
    assert out["next"]["error"] == "SwapFileLostError", out["next"]
    assert out["next"]["details"]["path"] in out["files"]
    assert out["after"]["error"] == "InvalidStateError" and "cannot continue" in out["after"]["message"]
    assert out["destroy"]["error"] is None, out["destroy"]



# 4. Lifetime, and what a broken engine can still do.
def train_on(engine, first: int, steps: int) -> list[float]:
    losses = []
    for step in range(first, first + steps):
        losses.append(forward_backward(engine, step))
        engine.step()
    return losses


def stage_2_on_nvme(nvme: str) -> dict:
    config = nvme_config(nvme, params=False)
    config["zero_optimization"]["stage"] = 2
    return config


def gradient_file_vanishes(rank, world, nvme: str, checkpoints: str) -> dict:
    engine, _, _, _ = zcore.initialize(model=make_model(MODEL), config=stage_2_on_nvme(nvme))
    train(engine, 1)
    (lost,) = [path for path in swap_files(nvme) if "-gradients-" in os.path.basename(path)]
    os.remove(lost)
    out = {"lost": lost, "backward": outcome(lambda: forward_backward(engine, 1))}
    out["next"] = outcome(lambda: forward_backward(engine, 1))
    out["save"] = outcome(lambda: engine.save_checkpoint(checkpoints))
    engine.destroy()
    out["left"] = os.listdir(nvme)
    return out


def test_a_vanished_gradient_swap_file_breaks_the_engine_at_the_backward(tmp_path: Path) -> None:
    """Stage 2: the gradient shards go to NVMe during backward, and the
    writes that find the file gone fail at the backward's end."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    out = run_ranks(gradient_file_vanishes, 1, str(nvme), str(tmp_path / "ckpt"), launcher=False, timeout=120)[0]
    assert out["backward"]["error"] == "SwapFileLostError", out["backward"]
    assert out["backward"]["details"]["path"] == out["lost"]
    for refused in (out["next"], out["save"]):
        assert refused["error"] == "InvalidStateError", refused
        assert "cannot continue" in refused["message"] and "SwapFileLostError" in refused["message"]
    assert not (tmp_path / "ckpt").exists()
    assert out["left"] == []


def disk_full_at_the_backward(rank, world, nvme: str, checkpoints: str) -> dict:
    engine, _, _, _ = zcore.initialize(model=make_model(MODEL), config=stage_2_on_nvme(nvme))
    engine.save_checkpoint(checkpoints, tag="start")
    filler = os.path.join(nvme, "filler")
    fill_up(filler)
    out = {"backward": outcome(lambda: forward_backward(engine, 0))}
    out["next"] = outcome(lambda: forward_backward(engine, 0))
    os.remove(filler)
    engine.load_checkpoint(checkpoints, tag="start")
    out["after_load"] = train(engine, 2)
    engine.destroy()
    fresh, _, _, _ = zcore.initialize(model=make_model(MODEL), config=stage_2_on_nvme(nvme))
    fresh.load_checkpoint(checkpoints, tag="start")
    out["fresh"] = train(fresh, 2)
    fresh.destroy()
    return out


def test_a_full_disk_at_the_backward_breaks_the_engine_until_a_checkpoint_is_loaded(
    nvme_tmpfs: Path, tmp_path: Path
) -> None:
    """The gradient file takes its blocks as the first backward writes it:
    a disk full by then fails that backward. Once space is freed, the last
    checkpoint loaded into the same engine replaces every state, and it
    trains on exactly as a new engine loading that checkpoint does."""
    out = run_ranks(
        disk_full_at_the_backward, 1, str(nvme_tmpfs), str(tmp_path / "ckpt"), launcher=False, timeout=120
    )[0]
    assert out["backward"]["error"] == "DiskFullError", out["backward"]
    assert out["next"]["error"] == "InvalidStateError" and "DiskFullError" in out["next"]["message"]
    assert out["after_load"] == out["fresh"]


def relative_path_then_chdir(rank, world, base: str) -> dict:
    os.chdir(base)
    os.mkdir("swap")
    engine, _, _, _ = zcore.initialize(model=make_model(MODEL), config=nvme_config("swap"))
    losses = train(engine, 1)
    os.mkdir("elsewhere")
    os.chdir("elsewhere")
    losses += train_on(engine, 1, 2)
    files = [os.path.basename(p) for p in swap_files(os.path.join(base, "swap"))]
    engine.destroy()
    return {"losses": losses, "files": files, "left": os.listdir(os.path.join(base, "swap"))}


def test_a_relative_nvme_path_stays_where_it_was_at_initialize(tmp_path: Path) -> None:
    out = run_ranks(relative_path_then_chdir, 1, str(tmp_path), launcher=False, timeout=120)[0]
    reference = run_ranks(train_in_a_directory, 1, str(tmp_path / "absolute"), launcher=False, timeout=120)[0]
    assert len(out["files"]) == 3, out["files"]  # parameters, gradients, optimizer states
    assert out["losses"] == reference
    assert out["left"] == [] and not (tmp_path / "elsewhere" / "swap").exists()


def train_in_a_directory(rank, world, nvme: str) -> list[float]:
    os.makedirs(nvme)
    engine, _, _, _ = zcore.initialize(model=make_model(MODEL), config=nvme_config(nvme))
    losses = train(engine, 3)
    engine.destroy()
    return losses


def dropped_engines(rank, world, nvme: str) -> dict:
    import gc
    import weakref

    left = {}
    for stage in (2, 3):
        config = nvme_config(nvme, params=stage == 3)
        config["zero_optimization"]["stage"] = stage
        engine, _, _, _ = zcore.initialize(model=make_model(MODEL), config=config)
        train(engine, 2)
        during = len(swap_files(nvme))
        gone = weakref.ref(engine)
        del engine
        gc.collect()
        left[stage] = {"during": during, "collected": gone() is None, "after": swap_files(nvme)}
    return left


def test_an_engine_dropped_without_destroy_takes_its_swap_files_when_collected(tmp_path: Path) -> None:
    out = run_ranks(dropped_engines, 1, str(tmp_path), launcher=False, timeout=120)[0]
    for stage, left in out.items():
        assert left["during"] >= 2 and left["collected"], (stage, left)
        assert left["after"] == [], (stage, left)


def destroyed_engine(rank, world, nvme: str, checkpoints: str) -> dict:
    engine, _, _, _ = zcore.initialize(model=make_model(MODEL), config=nvme_config(nvme))
    train(engine, 1)
    engine.destroy()
    return {
        "again": outcome(engine.destroy),
        "forward": outcome(lambda: forward_backward(engine, 1)),
        "step": outcome(engine.step),
        "save": outcome(lambda: engine.save_checkpoint(checkpoints)),
        "load": outcome(lambda: engine.load_checkpoint(checkpoints)),
        "state_dict": outcome(engine.full_state_dict),
        "memory": outcome(engine.memory_report),
    }


def test_a_destroyed_engine_says_so_when_used(tmp_path: Path) -> None:
    out = run_ranks(destroyed_engine, 1, str(tmp_path), str(tmp_path / "ckpt"), launcher=False, timeout=120)[0]
    assert out.pop("again")["error"] is None
    for use, got in out.items():
        assert got["error"] == "InvalidStateError" and "was destroyed" in got["message"], (use, got)
