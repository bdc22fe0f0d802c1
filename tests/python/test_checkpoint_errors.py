"""Checkpoints that must be refused: corrupted bytes, another model or
optimizer, a newer format, unsafe names; and a failed load changes nothing."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zcore
from zcore.checkpoint import durable
from distributed import run_ranks
from models import forward, global_batch, loss_of, make_model
from training import zcore_config

TAG = "t1"


def config(stage: int = 3, **extra) -> dict:
    return zcore_config(stage, 1, 1.0, train_batch_size=4, **extra)


def trained_engine(stage: int = 3, model: nn.Module | None = None, steps: int = 2, **extra):
    engine, *_ = zcore.initialize(model=model or make_model("gpt"), config=config(stage, **extra))
    for step in range(steps):
        x, y = global_batch("gpt", step, 4)
        engine.backward(loss_of("gpt", forward("gpt", engine, x, step, 0), y))
        engine.step()
    return engine


def save_one(rank: int, world: int, ckpt: str) -> None:
    trained_engine().save_checkpoint(ckpt, tag=TAG)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pristine") / "ckpt"
    run_ranks(save_one, 2, str(path))
    return path


@pytest.fixture
def ckpt(pristine: Path, tmp_path: Path) -> Path:
    """A stage-3 checkpoint saved by 2 ranks, the test's own copy."""
    shutil.copytree(pristine, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def snapshot(engine) -> tuple[dict, list, int]:
    state = engine.full_state_dict()
    pieces = [p for g in engine.optimizer.param_groups for p in g["params"]]
    adam = [{k: v.clone() for k, v in engine.optimizer.state[p].items()} for p in pieces]
    return state, adam, engine.global_steps


def assert_unchanged(before, after) -> None:
    assert before[0].keys() == after[0].keys()
    assert all(torch.equal(before[0][k], after[0][k]) for k in before[0])
    assert all(torch.equal(a[k], b[k]) for a, b in zip(before[1], after[1]) for k in a)
    assert before[2] == after[2]


def load_expecting(rank: int, world: int, ckpt: str, model_name: str, error: str, extra: dict | None = None) -> str:
    """Loads into a trained engine (another state than the checkpoint's);
    returns the error message, after checking nothing changed."""
    model = BiggerGPT() if model_name == "bigger" else None
    engine = trained_engine(model=model, steps=1, **(extra or {}))
    before = snapshot(engine)
    with pytest.raises(getattr(zcore, error)) as info:
        engine.load_checkpoint(ckpt, tag=TAG)
    assert_unchanged(before, snapshot(engine))
    return str(info.value)


def BiggerGPT() -> nn.Module:
    model = make_model("gpt")
    model.extra = nn.Linear(4, 4)  # a parameter the checkpoint lacks
    with torch.no_grad():
        model.wpe.weight = nn.Parameter(torch.zeros(32, 32))  # another shape
    return model


def flip_byte(path: Path, position: int) -> None:
    """Negative positions count from the end."""
    data = bytearray(path.read_bytes())
    data[position] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["weights", "state", "header", "index"])
def test_a_flipped_byte_is_detected_and_named(ckpt: Path, where: str) -> None:
    tag = ckpt / TAG
    target = {
        "weights": (tag / "weights-00001.safetensors", -3),
        "state": (tag / "state-00000.safetensors", -6000),  # in exp_avg_sq, before the 5056 RNG bytes
        "header": (tag / "weights-00000.safetensors", 20),
        "index": (tag / "rank-00001.json", -40),
    }[where]
    path, position = target
    flip_byte(path, position)
    messages = run_ranks(load_expecting, 2, str(ckpt), "gpt", "CheckpointCorruptError")
    assert path.name in messages[0] or path.name in messages[1]
    # Consolidation reads the weights and refuses them too.
    if where in ("weights", "header", "index"):
        with pytest.raises(zcore.CheckpointCorruptError, match=path.name):
            zcore.checkpoint.consolidate(ckpt, ckpt.parent / "out", tag=TAG, progress=False)


def test_another_model_is_refused_naming_the_differences(ckpt: Path) -> None:
    message = run_ranks(load_expecting, 2, str(ckpt), "bigger", "CheckpointMismatchError")[0]
    assert "extra.weight" in message and "extra.bias" in message  # missing from the checkpoint
    assert "wpe.weight: saved [16, 32], model [32, 32]" in message


def test_another_optimizer_is_refused(ckpt: Path) -> None:
    adam = {"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "adam_w_mode": False}}}  # L2, not AdamW
    message = run_ranks(load_expecting, 2, str(ckpt), "gpt", "CheckpointMismatchError", adam)[0]
    assert "AdamW" in message and "load_optimizer_states=False" in message


def load_optimizer_groups_differ(rank: int, world: int, ckpt: str) -> str:
    model = make_model("gpt")
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    cfg = config()
    cfg.pop("optimizer")
    optimizer = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-3)
    engine, *_ = zcore.initialize(model=model, config=cfg, optimizer=optimizer)
    with pytest.raises(zcore.CheckpointMismatchError) as info:
        engine.load_checkpoint(ckpt, tag=TAG)
    # Weights alone still load.
    engine.load_checkpoint(ckpt, tag=TAG, load_optimizer_states=False)
    return str(info.value)


def test_other_parameter_groups_are_refused(ckpt: Path) -> None:
    message = run_ranks(load_optimizer_groups_differ, 2, str(ckpt))[0]
    assert "1 optimizer parameter groups (its meta.json says), this engine 2" in message


def rewrite_json(path: Path, change) -> str:
    content = durable.read_json(path)
    change(content)
    return durable.write_json(path, content)


def test_a_newer_format_is_refused(ckpt: Path) -> None:
    rewrite_json(ckpt / TAG / "meta.json", lambda m: m.update(version=99))
    message = run_ranks(load_expecting, 1, str(ckpt), "gpt", "CheckpointError")[0]
    assert "format version 99" in message and "upgrade zcore" in message


def test_names_never_leave_the_checkpoint_directory(ckpt: Path, tmp_path: Path) -> None:
    (ckpt / "latest").write_text("../../etc")
    with pytest.raises(zcore.CheckpointError, match="not a plain file name"):
        zcore.checkpoint.consolidate(ckpt, tmp_path / "out", progress=False)
    # A file name in an index (with a valid checksum) pointing outside.
    tag = ckpt / TAG
    checksum = rewrite_json(tag / "rank-00000.json", lambda ix: ix["files"]["weights"].update(name="../secret"))
    rewrite_json(tag / "meta.json", lambda m: m["ranks"].__setitem__(0, checksum))
    with pytest.raises(zcore.CheckpointError, match="not a plain file name"):
        zcore.checkpoint.consolidate(ckpt, tmp_path / "out", tag=TAG, progress=False)


def unsafe_or_missing_tags(rank: int, world: int, root: str) -> None:
    root = Path(root)
    engine = trained_engine(steps=0)
    for tag in ("../escape", "a/b", ".hidden", ""):
        with pytest.raises(zcore.CheckpointError, match="not a plain file name"):
            engine.save_checkpoint(root, tag=tag)
    assert engine.load_checkpoint(root / "nothing") == (None, None)
    engine.save_checkpoint(root, tag="here")
    with pytest.raises(zcore.CheckpointError, match="tags in .*: \\['here'\\]"):
        engine.load_checkpoint(root, tag="absent")


def test_unsafe_or_missing_tags_are_errors(tmp_path: Path) -> None:
    run_ranks(unsafe_or_missing_tags, 1, str(tmp_path), launcher=False)


def refuses_what_needs_pickle(rank: int, world: int, root: str) -> None:
    engine = trained_engine(steps=1)
    with pytest.raises(zcore.CheckpointError, match=r"client_state\['bad'\]"):
        engine.save_checkpoint(root, client_state={"bad": object()})
    assert not any(Path(root).iterdir())  # nothing was written


def test_state_that_would_need_pickle_is_refused(tmp_path: Path) -> None:
    run_ranks(refuses_what_needs_pickle, 1, str(tmp_path), launcher=False)


def refuses_mid_window(rank: int, world: int, root: str) -> None:
    engine, *_ = zcore.initialize(model=make_model("gpt"), config=zcore_config(3, 2, 1.0, train_batch_size=4))
    x, y = global_batch("gpt", 0, 2)
    engine.backward(loss_of("gpt", forward("gpt", engine, x, 0, 0), y))
    engine.step()
    with pytest.raises(zcore.CheckpointError, match="accumulation window"):
        engine.save_checkpoint(root)


def test_saving_inside_an_accumulation_window_is_refused(tmp_path: Path) -> None:
    run_ranks(refuses_mid_window, 1, str(tmp_path), launcher=False)


def full_disk(rank: int, world: int, root: str) -> None:
    root = Path(root)
    engine = trained_engine(steps=1)
    engine.save_checkpoint(root, tag="small")
    before = {f: (root / "small" / f).read_bytes() for f in os.listdir(root / "small")}
    fs = os.statvfs(root)
    filler = root / "filler"
    filler.write_bytes(b"\0" * (fs.f_bavail * fs.f_frsize - 64 * 1024))
    with pytest.raises(zcore.DiskFullError, match="no space left"):
        engine.save_checkpoint(root, tag="big")
    assert {f: (root / "small" / f).read_bytes() for f in os.listdir(root / "small")} == before
    assert (root / "latest").read_text() == "small"
    assert not (root / ".big.partial").exists() and not (root / "big").exists()
    filler.unlink()
    engine.load_checkpoint(root)


def test_a_full_disk_fails_cleanly_and_keeps_the_previous_checkpoint(small_fs: Path) -> None:
    """A 2 MiB filesystem, filled up to 64 KiB after a first checkpoint: the
    second save fails, the first stays as it was."""
    run_ranks(full_disk, 1, str(small_fs), launcher=False)


def fill_to_the_last_byte(root: Path) -> None:
    """Writes a file into ``root`` until its filesystem has no byte left."""
    fd = os.open(root / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        for chunk in (65536, 512):
            try:
                while True:
                    os.write(fd, b"\0" * chunk)
            except OSError:
                pass
    finally:
        os.close(fd)
    assert os.statvfs(root).f_bavail == 0


def full_disk_at_the_directory(rank: int, world: int, root: str) -> None:
    root = Path(root)
    engine = trained_engine(steps=1)
    engine.save_checkpoint(root, tag="small")
    dist.barrier()
    before = {f: (root / "small" / f).read_bytes() for f in os.listdir(root / "small")}
    if rank == 0:
        fill_to_the_last_byte(root)
    dist.barrier()
    with pytest.raises(zcore.DiskFullError) as caught:
        engine.save_checkpoint(root, tag="big")
    message = str(caught.value)
    assert "no space left on the device creating the directory" in message, message
    assert str(root / ".big.partial") in message and "bytes free" in message, message
    if rank == 0:
        assert caught.value.path == str(root / ".big.partial") and caught.value.available == 0
        assert f"it needs {os.statvfs(root).f_frsize} bytes, its filesystem has 0 bytes free" in message
    else:
        assert "failed on rank 0" in message, message
    assert {f: (root / "small" / f).read_bytes() for f in os.listdir(root / "small")} == before
    assert (root / "latest").read_text() == "small"
    assert not (root / ".big.partial").exists() and not (root / "big").exists()


def test_a_disk_without_a_free_byte_fails_the_save_as_every_full_disk_does(small_ext4: Path) -> None:
    """ext4 with 0 bytes free: the staging directory itself cannot be made.
    Every rank gets the DiskFullError of a full disk, naming the directory
    and the bytes, and the previous checkpoint stays as it was."""
    run_ranks(full_disk_at_the_directory, 2, str(small_ext4))


def refuses_complex_client_state(rank: int, world: int, root: str) -> None:
    engine = trained_engine(steps=1)
    bad = {"step": 3, "phases": torch.polar(torch.ones(4), torch.arange(4.0))}  # complex64
    for who in ("rank 0", "every rank"):
        state = bad if rank == 0 or who == "every rank" else {"step": 3}
        with pytest.raises(zcore.CheckpointError) as caught:
            engine.save_checkpoint(root, tag="t", client_state=state)
        message = str(caught.value)
        assert "client_state['phases'] is a tensor of dtype torch.complex64" in message, (who, message)
        assert "they hold torch.float64, torch.float32, torch.float16, torch.bfloat16" in message, message
        assert state is bad or "failed on rank 0" in message, (who, message)
        assert not os.path.exists(Path(root) / ".t.partial") and not os.path.exists(Path(root) / "t")


def test_a_tensor_of_a_dtype_files_cannot_hold_is_refused_on_every_rank_naming_its_key(tmp_path: Path) -> None:
    run_ranks(refuses_complex_client_state, 2, str(tmp_path))


def test_index_json_is_plain_json(ckpt: Path) -> None:
    """Metadata is readable by any JSON reader (no pickle anywhere)."""
    meta = json.loads((ckpt / TAG / "meta.json").read_text())
    assert meta["content"]["format"] == "zcore-checkpoint"
    assert not list((ckpt / TAG).glob("*.pt")) and not list((ckpt / TAG).glob("*.pkl"))


def test_garbage_rng_on_one_rank_fails_every_rank_and_changes_nothing(ckpt: Path) -> None:
    """Re-signed, and of the right types and lengths: rank 1's python RNG
    position past the end of its words, which only setting the state finds.
    Before, rank 0 loaded (and reported success) while rank 1 raised after
    its weights, optimizer state and counters were replaced."""
    tag = ckpt / TAG
    checksum = rewrite_json(tag / "rank-00001.json", lambda ix: ix["rng"]["python"][1].__setitem__(-1, 1000))
    rewrite_json(tag / "meta.json", lambda m: m["ranks"].__setitem__(1, checksum))
    messages = run_ranks(load_expecting, 2, str(ckpt), "gpt", "CheckpointCorruptError")
    assert "rank-00001.json" in messages[1] and "rng" in messages[1]
    assert "failed on rank 1" in messages[0] and "rank-00001.json" in messages[0]


def load_with_own_dir(rank: int, world: int, dirs: list[str], tag) -> tuple[str, float]:
    engine = trained_engine(steps=1)
    before = snapshot(engine)
    started = time.monotonic()
    with pytest.raises(zcore.CheckpointError) as info:
        engine.load_checkpoint(dirs[rank], tag=tag)
    elapsed = time.monotonic() - started
    assert_unchanged(before, snapshot(engine))
    return str(info.value), elapsed


@pytest.mark.parametrize("case", ["empty directory", "missing tag", "unreadable index"])
def test_when_one_rank_cannot_load_every_rank_fails_at_once(ckpt: Path, tmp_path: Path, case: str) -> None:
    """Rank 1 sees another directory (as a node whose mount is missing
    would). Before, rank 0 waited in a collective for the process group's
    10-minute timeout; the 60 s deadline fails the test instead."""
    other = tmp_path / "other"
    if case == "empty directory":
        other.mkdir()
        tag = None
    else:
        shutil.copytree(ckpt, other)
        tag = TAG
        if case == "missing tag":
            shutil.rmtree(other / TAG)
        else:
            (other / TAG / "rank-00000.json").unlink()
            (other / TAG / "rank-00000.json").mkdir()
    messages = run_ranks(load_with_own_dir, 2, [str(ckpt), str(other)], tag, timeout=60)
    reason = {"empty directory": "ranks found different checkpoints", "missing tag": "no complete checkpoint",
              "unreadable index": "is a directory, not a regular file"}[case]
    for message, elapsed in messages:
        assert reason in message and elapsed < 30
    if case != "empty directory":
        assert "failed on rank 1" in messages[0][0]


def tags_differ(rank: int, world: int, root: str) -> list[str]:
    engine = trained_engine(steps=1)
    messages = []
    engine.save_checkpoint(root, tag="shared")
    for call in (
        lambda: engine.save_checkpoint(root, tag=f"rank{rank}"),
        lambda: engine.load_checkpoint(root, tag="shared" if rank == 0 else None),
    ):
        with pytest.raises(zcore.CheckpointError) as raised:
            call()
        messages.append(str(raised.value))
    engine.load_checkpoint(root, tag="shared")  # the same tag everywhere still works
    return messages


def test_different_tags_on_different_ranks_are_named_on_every_rank(tmp_path: Path) -> None:
    for messages in run_ranks(tags_differ, 2, str(tmp_path)):
        save, load = messages
        assert "tags differ across ranks (rank 0: 'rank0', rank 1: 'rank1')" in save, save
        assert "tags differ across ranks (rank 0: 'shared', rank 1: none (latest))" in load, load
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "shared"]  # nothing half-written


def directories_refused(rank: int, world: int, cwd: str) -> list[str]:
    os.chdir(cwd)  # where an empty save_dir would have written
    engine = trained_engine(stage=1, steps=1)
    messages = []
    for call in (lambda: engine.save_checkpoint(""), lambda: engine.save_checkpoint(None),
                 lambda: engine.load_checkpoint("")):
        with pytest.raises(zcore.InvalidArgumentError) as failure:
            call()
        messages.append(str(failure.value))
    engine.destroy()
    return messages


def test_a_save_or_load_directory_that_names_none_is_refused(tmp_path: Path) -> None:
    """The empty string would be the working directory: refused, as DeepSpeed refuses it."""
    messages = run_ranks(directories_refused, 1, str(tmp_path), launcher=False)[0]
    assert [m.split(" must")[0] for m in messages] == ["save_dir", "save_dir", "load_dir"]
    assert list(tmp_path.iterdir()) == []
