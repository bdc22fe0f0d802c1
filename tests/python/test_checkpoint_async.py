"""Asynchronous checkpoint saves (``save_checkpoint(async_save=True)``):
the files equal a synchronous save's of the same step byte for byte while
training changes every value before the write; saves queue; destroy and
process exit finish a pending save; a full disk raises on every rank at the
next save or wait; the host copy is reported and estimated.

The background write is held back (``gated``) until the test releases it,
so that what happens meanwhile is not left to timing."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import zcore
from zcore.checkpoint import async_save
from distributed import run_ranks
from models import forward, global_batch, loss_of, make_model
from training import zcore_config

TAG = "t"


def config(nvme: str = "", **extra) -> dict:
    zero = {"offload_optimizer": {"device": "nvme", "nvme_path": nvme}} if nvme else {}
    return zcore_config(2 if nvme else 3, 1, 1.0, train_batch_size=4, zero=zero, **extra)


def train(engine, steps: range, name: str = "gpt") -> None:
    for step in steps:
        x, y = global_batch(name, step, 4)
        engine.backward(loss_of(name, forward(name, engine, x, step, 0), y))
        engine.step()


def gated() -> threading.Event:
    """Holds every background write of this process until the event is set."""
    gate = threading.Event()
    original = async_save.write_save

    def held(*args, **kwargs):
        assert gate.wait(120), "the test never released the background write"
        return original(*args, **kwargs)

    async_save.write_save = held
    return gate


def files_of(tag_dir: Path) -> dict[str, bytes]:
    """Every file of a tag but owner.json (which records when and by whom)."""
    return {p.name: p.read_bytes() for p in sorted(tag_dir.iterdir()) if p.name != "owner.json"}


def same_bytes_as_a_synchronous_save(rank: int, world: int, root: str, nvme: str) -> None:
    root = Path(root)
    engine, *_ = zcore.initialize(model=make_model("gpt"), config=config(nvme))
    train(engine, range(2))
    client = {"epoch": 3, "ema": torch.arange(5.0)}
    engine.save_checkpoint(root / "sync", tag=TAG, client_state=client)
    expected = engine.full_state_dict()
    gate = gated()
    returned = engine.save_checkpoint(root / "async", tag=TAG, client_state=client, async_save=True)
    assert returned == root / "async" / TAG
    assert not returned.exists() and engine.checkpoints.state is async_save.SaveState.WRITING
    client["ema"].add_(100.0)  # the caller's tensors change too: the copy holds them as they were
    train(engine, range(2, 4))  # every master value, moment and NVMe sub-group changes in place
    gate.set()
    engine.wait_for_checkpoint()
    assert engine.checkpoints.state is async_save.SaveState.IDLE
    assert files_of(root / "async" / TAG) == files_of(root / "sync" / TAG)
    assert (root / "async" / "latest").read_text() == TAG
    assert not list((root / "async").glob(".*.partial"))
    engine.destroy()

    fresh, *_ = zcore.initialize(model=make_model("gpt"), config=config(nvme))
    _, loaded_client = fresh.load_checkpoint(root / "async")
    state = fresh.full_state_dict()
    if rank == 0:  # the state of the step it was saved at, not of the steps trained while it was written
        assert state.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(state[key], value), key
        assert loaded_client["epoch"] == 3 and torch.equal(loaded_client["ema"], torch.arange(5.0))
    fresh.destroy()


@pytest.mark.parametrize("where", ["stage 3", "stage 2, optimizer on nvme"])
def test_an_async_save_writes_the_bytes_of_a_synchronous_save_of_its_step(tmp_path: Path, where: str) -> None:
    nvme = str(tmp_path / "nvme") if "nvme" in where else ""
    run_ranks(same_bytes_as_a_synchronous_save, 2, str(tmp_path), nvme, timeout=240)


def copied_behind_the_loop(rank: int, world: int, root: str) -> None:
    """Stage 3 in memory: the trained and frozen values are copied by the
    writer's thread while the loop goes on; buffers and client_state at once."""
    root = Path(root)
    engine, *_ = zcore.initialize(model=make_model("norm"), config=config())
    train(engine, range(2), "norm")
    client = {"ema": torch.arange(5.0)}
    engine.save_checkpoint(root / "sync", tag=TAG, client_state=client)
    copying, gate = threading.Event(), threading.Event()
    original = async_save.SnapshotBuffer.copy

    def held_copy(self, payload, defer_settled=False):
        copied, finish = original(self, payload, defer_settled)

        def held_finish():
            copying.set()
            assert gate.wait(120), "the test never released the copy"
            finish()

        return copied, held_finish

    async_save.SnapshotBuffer.copy = held_copy
    engine.save_checkpoint(root / "async", tag=TAG, client_state=client, async_save=True)
    assert copying.wait(60)  # the settled values are being copied behind the loop
    client["ema"].add_(100.0)
    x, y = global_batch("norm", 5, 4)
    engine.backward(loss_of("norm", forward("norm", engine, x, 5, 0), y))  # batch norm's statistics move
    threading.Timer(0.5, gate.set).start()
    head = engine.module.head.weight
    with zcore.GatheredParameters([head], modifier_rank=0), torch.no_grad():
        head.add_(1.0)
    assert gate.is_set()  # the write-back waited for the copy
    engine.step()
    train(engine, range(6, 8), "norm")
    engine.wait_for_checkpoint()
    assert files_of(root / "async" / TAG) == files_of(root / "sync" / TAG)
    engine.destroy()


def test_values_only_a_step_changes_are_copied_behind_the_loop_before_the_step(tmp_path: Path) -> None:
    """A forward (batch norm's buffers), the caller (client_state) and a
    GatheredParameters write-back, between the save and its copy's end,
    leave the files those of a synchronous save of the step saved."""
    run_ranks(copied_behind_the_loop, 2, str(tmp_path), timeout=180)


def saves_queue(rank: int, world: int, root: str) -> None:
    root = Path(root)
    engine, *_ = zcore.initialize(model=make_model("gpt"), config=config())
    train(engine, range(1))
    gate = gated()
    engine.save_checkpoint(root, tag="a", async_save=True)
    train(engine, range(1, 2))
    threading.Timer(0.5, gate.set).start()
    engine.save_checkpoint(root, tag="b", async_save=True)  # waits for "a" first
    assert (root / "a" / "meta.json").exists()
    engine.destroy()  # finishes "b"
    assert (root / "b" / "meta.json").exists() and (root / "latest").read_text() == "b"
    assert not list(root.glob(".*.partial"))


def test_a_second_save_waits_for_the_first_and_destroy_finishes_the_last(tmp_path: Path) -> None:
    run_ranks(saves_queue, 2, str(tmp_path), timeout=180)


def config_key_saves_in_the_background(rank: int, world: int, root: str) -> list:
    root = Path(root)
    engine, *_ = zcore.initialize(model=make_model("gpt"), config=config(checkpoint={"async_save": True}))
    train(engine, range(1))
    gate = gated()
    engine.save_checkpoint(root, tag="a")
    pending = engine.checkpoints.state
    gate.set()
    engine.save_checkpoint(root, tag="b", async_save=False)  # waits for "a", then writes "b" itself
    done = engine.checkpoints.state
    report = engine.memory_report()
    engine.destroy()
    return [pending, done, (root / "a" / "meta.json").exists(), (root / "latest").read_text(), report]


def test_the_config_key_makes_saves_asynchronous_and_the_copy_is_reported_and_estimated(tmp_path: Path) -> None:
    cfg = config(checkpoint={"async_save": True})
    results = run_ranks(config_key_saves_in_the_background, 2, str(tmp_path), timeout=180)
    for pending, done, a_saved, latest, _ in results:
        assert (pending, done, a_saved, latest) == (async_save.SaveState.WRITING, async_save.SaveState.IDLE, True, "b")
    estimate = zcore.estimate_memory(make_model("gpt"), cfg, 2, device="cpu").tiers["host"].checkpoint_copy
    assert zcore.estimate_memory(make_model("gpt"), config(), 2, device="cpu").tiers["host"].checkpoint_copy == 0
    measured = results[0][4].checkpoint_copy  # rank 0's, which writes the buffers and client state
    assert "host memory held for asynchronous checkpoint saves" in str(results[0][4])
    # The copy also holds the RNG state (5056 bytes) and aligns each tensor to 64 bytes.
    tensors = 3 * len(list(make_model("gpt").parameters())) + 2
    assert 0 <= measured - estimate <= 5056 + 64 * tensors, (measured, estimate)


def full_disk(rank: int, world: int, root: str) -> None:
    root = Path(root)
    engine, *_ = zcore.initialize(model=make_model("gpt"), config=config())
    train(engine, range(1))
    engine.save_checkpoint(root, tag="small")
    before = files_of(root / "small")
    torch.distributed.barrier()
    if rank == 0:
        fs = os.statvfs(root)
        (root / "filler").write_bytes(b"\0" * (fs.f_bavail * fs.f_frsize - 64 * 1024))
    torch.distributed.barrier()
    for raised_by in ("wait", "the next save"):
        engine.save_checkpoint(root, tag="big", async_save=True)  # the copy succeeds; the write cannot
        train(engine, range(1, 2))
        with pytest.raises(zcore.DiskFullError) as caught:
            if raised_by == "wait":
                engine.wait_for_checkpoint()
            else:
                engine.save_checkpoint(root, tag="next", async_save=True)
        message = str(caught.value)
        assert "no space left on the device" in message and ".big.partial" in message, message
        assert "bytes free" in message, message
        if sys.version_info >= (3, 11):  # where exceptions take notes
            assert "asynchronous save of tag 'big'" in str(caught.value.__notes__)
        assert files_of(root / "small") == before and (root / "latest").read_text() == "small"
        assert not (root / ".big.partial").exists() and not (root / "big").exists() and not (root / "next").exists()
        engine.wait_for_checkpoint()  # raised once: nothing pending now
    torch.distributed.barrier()
    if rank == 0:
        (root / "filler").unlink()
    torch.distributed.barrier()
    engine.save_checkpoint(root, tag="later", async_save=True)
    engine.wait_for_checkpoint()
    assert (root / "latest").read_text() == "later"
    engine.load_checkpoint(root)
    engine.destroy()


def test_a_disk_filled_during_a_background_write_raises_on_every_rank_and_keeps_the_previous(small_fs: Path) -> None:
    run_ranks(full_disk, 2, str(small_fs), timeout=180)


EXITING = """
import sys, time
sys.path.insert(0, {tests!r})
import zcore
from zcore.checkpoint import async_save
from models import forward, global_batch, loss_of, make_model
from training import zcore_config

original = async_save.write_save
def slow(*args, **kwargs):
    time.sleep(1.0)  # still writing when the script ends
    return original(*args, **kwargs)
async_save.write_save = slow
engine, *_ = zcore.initialize(model=make_model("gpt"), config=zcore_config(3, 1, 1.0, train_batch_size=4))
x, y = global_batch("gpt", 0, 4)
engine.backward(loss_of("gpt", forward("gpt", engine, x, 0, 0), y))
engine.step()
engine.save_checkpoint({root!r}, tag="at-exit", async_save=True)
print("returned", engine.checkpoints.state.name, flush=True)
"""


def load_and_step(rank: int, world: int, root: str) -> str:
    engine, *_ = zcore.initialize(model=make_model("gpt"), config=config())
    path, _ = engine.load_checkpoint(root)
    train(engine, range(1, 2))
    return path.name


def test_process_exit_finishes_a_pending_save(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    script = EXITING.format(tests=str(Path(__file__).parent), root=str(root))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240, check=False,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr
    assert "returned WRITING" in done.stdout.splitlines(), done.stdout
    assert (root / "latest").read_text() == "at-exit" and (root / "at-exit" / "meta.json").exists()
    assert run_ranks(load_and_step, 1, str(root), launcher=False) == ["at-exit"]
