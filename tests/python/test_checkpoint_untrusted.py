"""A checkpoint directory as untrusted input: tags that would overwrite the
directory's own files or a user's, files replaced by FIFOs or grown huge,
staging directories left by killed saves, and metadata edited and re-signed
(a mutation fuzz: every mutation loads or raises zcore's checkpoint error
naming the file, and a refused load leaves the engine unchanged)."""

from __future__ import annotations

import json
import math
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import zcore
from zcore.checkpoint import durable, partials
from distributed import run_ranks
from models import forward, global_batch, loss_of, make_model
from training import zcore_config

CONFIG = zcore_config(
    2, 1, 1.0, train_batch_size=4,
    fp16={"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2},
    scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": 1e-2}},
)


def trained_engine(steps: int = 2):
    engine, *_ = zcore.initialize(model=make_model("gpt"), config=CONFIG)
    for step in range(steps):
        x, y = global_batch("gpt", step, 4)
        engine.backward(loss_of("gpt", forward("gpt", engine, x, step, 0), y))
        engine.step()
    return engine


def snapshot(engine) -> dict:
    pieces = [p for g in engine.optimizer.param_groups for p in g["params"]]
    return {
        "weights": {k: v.clone() for k, v in engine.full_state_dict().items()},
        "adam": [{k: v.clone() for k, v in engine.optimizer.state[p].items()} for p in pieces],
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups],
        "counters": (engine.global_steps, engine.global_samples, engine.micro_steps, engine.skipped_steps),
        "scaler": engine.optimizer.precision.scaler.state_dict(),
        "scheduler": engine.lr_scheduler.state_dict(),
        "attributes": sorted(vars(engine)),
    }


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


# Tags.
def tags_that_collide(rank: int, world: int, root: str) -> None:
    root = Path(root)
    engine = trained_engine(steps=1)
    engine.save_checkpoint(root, tag="first")
    (root / "notes.txt").write_text("mine")
    (root / "data").mkdir()
    for tag, match in (("latest", "records the latest tag"), (".first.partial", "not a plain file name"),
                       ("notes.txt", "not a zcore checkpoint"), ("data", "not a zcore checkpoint")):
        with pytest.raises(zcore.CheckpointError, match=match) as info:
            engine.save_checkpoint(root, tag=tag)
        if "records" in match or "plain" in match:
            assert "allowed tags" in str(info.value)
    assert (root / "notes.txt").read_text() == "mine" and (root / "latest").read_text() == "first"
    assert sorted(p.name for p in root.iterdir()) == ["data", "first", "latest", "notes.txt"]
    engine.save_checkpoint(root, tag="first")  # a checkpoint may be replaced
    assert engine.load_checkpoint(root)[0] == root / "first"


def test_tags_that_collide_with_the_directory_or_a_users_files_are_refused(tmp_path: Path) -> None:
    run_ranks(tags_that_collide, 1, str(tmp_path), launcher=False)


# Files replaced by FIFOs, or grown huge.
def replaced_files(rank: int, world: int, root: str) -> list[str]:
    root = Path(root)
    engine = trained_engine(steps=1)
    engine.save_checkpoint(root, tag="t")
    before = snapshot(engine)
    messages = []
    for name in ("latest", "t/meta.json", "t/rank-00000.json", "t/weights-00000.safetensors"):
        path = root / name
        saved = path.read_bytes()
        path.unlink()
        os.mkfifo(path)
        with pytest.raises(zcore.CheckpointError, match="is a FIFO, not a regular file") as info:
            engine.load_checkpoint(root)
        messages.append(str(info.value))
        path.unlink()
        path.write_bytes(saved)
    assert same(before, snapshot(engine))
    (root / "latest").write_bytes(b"t" * 300_000)
    with pytest.raises(zcore.CheckpointCorruptError, match="latest is 300000 bytes long") as info:
        engine.load_checkpoint(root)
    messages.append(str(info.value))
    return messages


def test_files_replaced_by_fifos_or_grown_huge_fail_at_once(tmp_path: Path) -> None:
    """Each load would block forever on a FIFO: the 60 s deadline fails the
    test instead."""
    messages = run_ranks(replaced_files, 1, str(tmp_path), launcher=False, timeout=60)[0]
    for message, name in zip(messages, ("latest", "meta.json", "rank-00000.json", "weights-00000.safetensors", "latest")):
        assert name in message
    assert len(messages[-1]) < 500  # the 300 kB of content are not quoted


# Staging directories left by killed saves.
def marked(root: Path, name: str, **owner) -> Path:
    path = root / name
    path.mkdir()
    (path / "weights-00000.safetensors").write_bytes(b"\0" * 1000)
    durable.write_json(path / "owner.json", {"host": socket.gethostname(), "pid": 1, "start_ticks": 0,
                                             "created": time.time(), **owner})
    return path


def test_only_abandoned_partials_of_zcore_are_removed(tmp_path: Path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.1)
        ticks = partials._start_ticks(alive.pid)
        dead = marked(tmp_path, ".global_step3.partial", pid=dead_pid, start_ticks=12345)
        reused = marked(tmp_path, ".global_step4.partial", pid=alive.pid, start_ticks=ticks + 1)
        live = marked(tmp_path, ".global_step5.partial", pid=alive.pid, start_ticks=ticks)
        old_remote = marked(tmp_path, ".a.partial", host="elsewhere", created=time.time() - 86400)
        new_remote = marked(tmp_path, ".b.partial", host="elsewhere", created=time.time() + 60)
        users = tmp_path / ".notes.partial"
        users.mkdir()
        (users / "keep.txt").write_text("mine")
        partials.remove_abandoned(tmp_path)
    finally:
        alive.kill()
        alive.wait()
    assert not dead.exists() and not reused.exists() and not old_remote.exists()
    assert live.exists() and new_remote.exists() and (users / "keep.txt").read_text() == "mine"


def killed_save_then_save(rank: int, world: int, root: str, phase: str) -> list[str]:
    root = Path(root)
    engine = trained_engine(steps=1)
    if phase == "kill":
        original = durable.TempFile.commit

        def dying(self):
            if self.path.name == "rank-00000.json":
                os.kill(os.getpid(), 9)
            return original(self)

        durable.TempFile.commit = dying
        engine.save_checkpoint(root)  # tag global_step1
    engine.save_checkpoint(root, tag="other")
    return sorted(p.name for p in root.iterdir())


def test_a_killed_saves_staging_is_removed_by_the_next_save_of_another_tag(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="died with exit code -9"):
        run_ranks(killed_save_then_save, 1, str(tmp_path), "kill", launcher=False)
    assert (tmp_path / ".global_step1.partial" / "weights-00000.safetensors").exists()
    assert run_ranks(killed_save_then_save, 1, str(tmp_path), "save", launcher=False)[0] == ["latest", "other"]


# Metadata edited and re-signed.
def paths_of(value, prefix=()):
    """Every (path, value) inside a JSON value; long lists sampled."""
    yield prefix, value
    if isinstance(value, dict):
        for k, v in value.items():
            yield from paths_of(v, (*prefix, k))
    elif isinstance(value, list):
        for i in sorted({0, len(value) // 2, len(value) - 1}) if value else ():
            yield from paths_of(value[i], (*prefix, i))


MUTATIONS = [
    lambda v, r: None, lambda v, r: "x/../y", lambda v, r: "", lambda v, r: True, lambda v, r: [],
    lambda v, r: {}, lambda v, r: {"k": v}, lambda v, r: [v], lambda v, r: 2**70, lambda v, r: -1,
    lambda v, r: -(2**70), lambda v, r: math.nan, lambda v, r: math.inf, lambda v, r: 1e308,
    lambda v, r: str(v), lambda v, r: 0.5, lambda v, r: "/etc/passwd", lambda v, r: "a\nb",
]


def mutate(content: dict, rnd: random.Random) -> str:
    path, value = rnd.choice([pv for pv in paths_of(content) if pv[0]])
    parent = content
    for part in path[:-1]:
        parent = parent[part]
    key = path[-1]
    action = rnd.randrange(len(MUTATIONS) + 2)
    if action == len(MUTATIONS):
        if isinstance(parent, dict):
            del parent[key]
        else:
            parent.pop(key)
        return f"removed {path}"
    if action == len(MUTATIONS) + 1:
        if isinstance(value, dict):
            value[rnd.choice(["extra", "optimizer", "__class__", "../x"])] = rnd.choice([None, 1, "s"])
            return f"added a key to {path}"
        if isinstance(value, list):
            value.append(rnd.choice([None, 1, "s", -1]))
            return f"appended to {path}"
    parent[key] = MUTATIONS[action % len(MUTATIONS)](value, rnd)
    return f"set {path} to {shown(parent[key])}"


def shown(v) -> str:
    return repr(v)[:60]


def fuzz(rank: int, world: int, root: str, seed: int, count: int) -> dict:
    root = Path(root)
    engine = trained_engine(steps=2)
    tag = engine.save_checkpoint(root, tag="t")
    meta, index = tag / "meta.json", tag / "rank-00000.json"
    pristine = {p: durable.read_json(p) for p in (meta, index)}
    before = snapshot(engine)
    rnd = random.Random(seed)
    outcomes = {"refused": 0, "loaded": 0}
    for _ in range(count):
        target = rnd.choice([meta, index])
        content = json.loads(json.dumps(pristine[target]))
        what = mutate(content, rnd)
        checksum = durable.write_json(target, content)
        if target == index:  # re-signed all the way: meta.json lists the index's checksum
            durable.write_json(meta, {**pristine[meta], "ranks": [checksum]})
        try:
            engine.load_checkpoint(root, tag="t")
        except zcore.CheckpointError as exc:
            assert target.name in str(exc), f"{what}: {exc}"
            after = snapshot(engine)
            assert same(before, after), f"{what}: the failed load changed the engine"
            outcomes["refused"] += 1
        else:
            # Whatever loaded is usable: a step runs (the attribute set stays the engine's own).
            assert snapshot(engine)["attributes"] == before["attributes"], what
            x, y = global_batch("gpt", 9, 4)
            engine.backward(loss_of("gpt", forward("gpt", engine, x, 9, 0), y))
            engine.step()
            outcomes["loaded"] += 1
            for p, c in pristine.items():
                durable.write_json(p, c)
            engine.load_checkpoint(root, tag="t")
            assert same(before, snapshot(engine)), f"{what}: reloading the pristine checkpoint"
        for p, c in pristine.items():
            durable.write_json(p, c)
    return outcomes


def test_edited_and_resigned_metadata_loads_or_is_refused_naming_the_file(tmp_path: Path) -> None:
    outcomes = run_ranks(fuzz, 1, str(tmp_path), 21, 300, launcher=False, timeout=240)[0]
    assert outcomes["refused"] > 200  # most mutations are not a valid checkpoint


def resigned_counters(rank: int, world: int, root: str) -> str:
    root = Path(root)
    engine = trained_engine(steps=1)
    tag = engine.save_checkpoint(root, tag="t")
    meta = durable.read_json(tag / "meta.json")
    meta["counters"]["optimizer"] = None
    durable.write_json(tag / "meta.json", meta)
    before = snapshot(engine)
    with pytest.raises(zcore.CheckpointCorruptError) as info:
        engine.load_checkpoint(root)
    assert same(before, snapshot(engine)) and engine.optimizer is not None
    return str(info.value)


def test_a_resigned_counter_that_names_an_engine_attribute_is_refused(tmp_path: Path) -> None:
    message = run_ranks(resigned_counters, 1, str(tmp_path), launcher=False)[0]
    assert "meta.json" in message and "counters.optimizer" in message and "tampering" in message


def resigned_empty_schedule(rank: int, world: int, root: str) -> str:
    root = Path(root)
    engine = trained_engine(steps=1)
    tag = engine.save_checkpoint(root, tag="t")
    meta = durable.read_json(tag / "meta.json")
    assert meta["lr_scheduler"]  # CONFIG schedules the learning rate
    meta["lr_scheduler"] = {}
    durable.write_json(tag / "meta.json", meta)
    before = snapshot(engine)
    with pytest.raises(zcore.CheckpointError) as info:
        engine.load_checkpoint(root)
    assert same(before, snapshot(engine))
    return str(info.value)


def test_a_resigned_schedule_without_its_position_is_refused(tmp_path: Path) -> None:
    """Found by the fuzz above: it raised a bare KeyError that named no file."""
    message = run_ranks(resigned_empty_schedule, 1, str(tmp_path), launcher=False)[0]
    assert "meta.json" in message and "lr_scheduler" in message and "last_batch_iteration" in message, message
