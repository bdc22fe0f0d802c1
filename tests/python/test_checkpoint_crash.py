"""A save killed with SIGKILL at any point leaves the previous checkpoint
loadable and bit-for-bit intact.

Each case trains, saves tag "a" completely, trains on, then saves again with
a fault injected into zcore's durable writes: the process kills itself when
it reaches the k-th file write or commit. Afterwards the files of "a" must
be unchanged, ``latest`` must name a complete tag, and loading it must
give exactly the state that tag was saved with. Each case runs twice: the
second save synchronous, and asynchronous (killed in its background writer
while the training goes on).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
from pathlib import Path
from typing import Optional

import pytest
import torch

import zcore
from zcore.checkpoint import durable
from distributed import run_ranks
from models import forward, global_batch, loss_of, make_model
from training import zcore_config

CONFIG = zcore_config(3, 1, 1.0, train_batch_size=4)


def train(engine, steps: range) -> None:
    for step in steps:
        x, y = global_batch("gpt", step, 4)
        engine.backward(loss_of("gpt", forward("gpt", engine, x, step, 0), y))
        engine.step()


def hashes(tag_dir: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(tag_dir.iterdir())}


def save_then_crash(
    rank: int, world: int, root: str, kind: str, kill_at: int, second_tag: str, dying_rank: int = 0,
    async_save: bool = False,
) -> int:
    root = Path(root)
    engine, *_ = zcore.initialize(model=make_model("gpt"), config=CONFIG)
    train(engine, range(2))
    engine.save_checkpoint(root, tag="a")
    expected = engine.full_state_dict()  # every rank gathers; rank 0 gets it
    if rank == 0:
        (root / "hashes-a.json").write_text(json.dumps(hashes(root / "a")))
        torch.save(expected, root / "expected-a.pt")
    train(engine, range(2, 3))
    expected = engine.full_state_dict()
    if rank == 0:
        torch.save(expected, root / f"expected-{second_tag}-new.pt")
    calls = [0]
    original = getattr(durable.TempFile, kind)

    def dying(self, *args):
        calls[0] += 1
        if calls[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, *args)

    if rank == dying_rank:
        setattr(durable.TempFile, kind, dying)
    engine.save_checkpoint(root, tag=second_tag, async_save=async_save)
    if async_save:
        train(engine, range(3, 4))  # while the background writer is killed
        engine.wait_for_checkpoint()
    return calls[0]  # never killed: kill_at was past the last call


def load_latest(rank: int, world: int, roots: list[str]) -> list[tuple[str, Optional[dict]]]:
    engine, *_ = zcore.initialize(model=make_model("gpt"), config=CONFIG)
    out = []
    for root in roots:
        path, _ = engine.load_checkpoint(root)
        state = engine.full_state_dict()  # every rank gathers; rank 0 gets it
        out.append((path.name, state if rank == 0 else None))
    return out


# (which durable call, the k-th call dies, the tag of the second save).
# A world-of-one save makes 6 commits: the staging directory's owner.json,
# weights, state, index, meta, latest (the tag directory is renamed between
# the 5th and the 6th).
CASES = [("commit", k, "b") for k in range(1, 7)] + [("commit", k, "a") for k in (4, 5, 6)] + [
    ("write", 3, "b"),  # inside the weights file
    ("write", 60, "b"),  # inside the state file
]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_killed_saves_leave_a_loadable_checkpoint(tmp_path: Path, async_save: bool) -> None:
    roots, rename_done = [], []
    for kind, kill_at, second in CASES:
        root = tmp_path / f"{kind}-{kill_at}-{second}"
        with pytest.raises(RuntimeError, match="died with exit code -9"):
            run_ranks(save_then_crash, 1, str(root), kind, kill_at, second, 0, async_save, launcher=False)
        roots.append(str(root))
        rename_done.append(kind == "commit" and kill_at == 6)
    for (kind, kill_at, second), root, renamed in zip(CASES, roots, rename_done):
        root = Path(root)
        assert (root / "latest").read_text() == "a", f"{kind} {kill_at}: latest moved"
        if not (renamed and second == "a"):  # the files of "a", bit for bit
            assert hashes(root / "a") == json.loads((root / "hashes-a.json").read_text()), kind
        # A killed save leaves only its staging directory behind (removed by the next save).
        assert sorted(p.name for p in root.iterdir() if p.is_dir()) in (
            ["a"], [".b.partial", "a"], [".a.partial", "a"], ["a", "b"]
        )
        if renamed and second == "b":
            assert (root / "b" / "meta.json").exists()  # complete, though latest still says "a"
    loaded = run_ranks(load_latest, 1, roots, launcher=False)[0]
    for (kind, kill_at, second), root, (name, state), renamed in zip(CASES, roots, loaded, rename_done):
        label = f"killed at {kind} {kill_at} of a save to {second!r}"
        expected_file = "expected-a-new.pt" if (renamed and second == "a") else "expected-a.pt"
        expected = torch.load(Path(root) / expected_file, weights_only=True)
        assert name == "a", label
        assert not list(Path(root).glob(".*.partial")), f"{label}: the load left the killed save's staging"
        assert state.keys() == expected.keys(), label
        for key, value in expected.items():
            assert torch.equal(state[key], value), f"{label}: {key}"


def save_twice_and_hash(rank: int, world: int, root: str) -> dict:
    root = Path(root)
    engine, *_ = zcore.initialize(model=make_model("gpt"), config=CONFIG)
    train(engine, range(1))
    engine.save_checkpoint(root, tag="a")
    first = hashes(root / "a")
    engine.save_checkpoint(root, tag="b")
    return {"first": first, "after": hashes(root / "a")}


def test_a_later_save_does_not_touch_earlier_tags(tmp_path: Path) -> None:
    result = run_ranks(save_twice_and_hash, 1, str(tmp_path), launcher=False)[0]
    assert result["first"] == result["after"]
    assert (tmp_path / "latest").read_text() == "b"


# Two ranks: (the rank that dies, which durable call, the k-th call dies).
# Each rank commits its weights, state and index (rank 0 after the staging
# directory's owner.json); rank 0 then meta.json (5) before the rename.
TWO_RANK_CASES = [(1, "commit", 1), (1, "write", 2), (0, "commit", 5)]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_rank_killed_while_two_ranks_save_leaves_a_loadable_checkpoint(tmp_path: Path, async_save: bool) -> None:
    """The other rank fails in its next collective (gloo: connection reset
    by the dead peer), as it would in a real job."""
    roots = []
    for dying, kind, kill_at in TWO_RANK_CASES:
        root = tmp_path / f"rank{dying}-{kind}-{kill_at}"
        with pytest.raises(RuntimeError, match=f"rank ({dying} died with exit code -9|{1 - dying} failed)"):
            run_ranks(save_then_crash, 2, str(root), kind, kill_at, "b", dying, async_save, timeout=120)
        assert (root / "latest").read_text() == "a"
        assert hashes(root / "a") == json.loads((root / "hashes-a.json").read_text())
        assert not (root / "b").exists()
        roots.append(str(root))
    loaded = run_ranks(load_latest, 2, roots)[0]
    for (dying, kind, kill_at), root, (name, state) in zip(TWO_RANK_CASES, roots, loaded):
        expected = torch.load(Path(root) / "expected-a.pt", weights_only=True)
        assert name == "a"
        assert state.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(state[key], value), f"rank {dying} killed at {kind} {kill_at}: {key}"
