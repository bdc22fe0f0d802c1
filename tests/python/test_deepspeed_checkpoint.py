"""Resuming a DeepSpeed run: ``zcore.load_deepspeed_checkpoint`` and
``zcore convert --from deepspeed`` read checkpoints DeepSpeed 0.19.8 wrote
(data/deepspeed_checkpoints, made by its make_checkpoints.py), and training
goes on as DeepSpeed's own continuation from them did (recorded beside each
checkpoint): the same losses, learning rates, loss scales and Adam steps.
Hostile and broken checkpoints are refused with a message naming the fault."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import zcore
from deepspeed_fixtures import CHECKPOINTS, FIXTURES, MICRO_BATCH, STEPS_AFTER_LOAD, STEPS_BEFORE_SAVE, batch, loss_of, model
from distributed import run_ranks
from zcore.checkpoint.deepspeed_files import open_checkpoint

RELATIVE = 1e-6
SAME_RUN = [name for name, (world, _) in FIXTURES.items() if world == 2]


def _recorded(name: str) -> dict:
    return json.loads((CHECKPOINTS / name / "continuation.json").read_text())


def _config(name: str, world: int, stage: int | None = None, gas: int = 1) -> dict:
    config = copy.deepcopy(FIXTURES[name][1])
    config["gradient_accumulation_steps"] = gas
    config["train_batch_size"] = MICRO_BATCH * world * gas
    if stage is not None:
        config["zero_optimization"]["stage"] = stage
    return config


def _continue(engine, micro_batches: list[int]) -> list[dict]:
    """STEPS_AFTER_LOAD optimizer steps, each over the micro-batches of the
    DeepSpeed ranks listed (one per micro-step)."""
    dtype = next(engine.module.parameters()).dtype
    steps = []
    for step in range(STEPS_BEFORE_SAVE, STEPS_BEFORE_SAVE + STEPS_AFTER_LOAD):
        losses = []
        for ds_rank in micro_batches:
            x, y = batch(step, ds_rank)
            loss = loss_of(engine(x.to(dtype)), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        steps.append({"losses": losses, "lr": engine.get_lr()[0], "loss_scale": engine.optimizer.loss_scale})
    return steps


def _state(engine) -> dict:
    inner = engine.optimizer.inner
    adam_steps = {float(s["step"]) for s in inner.state.values() if "step" in s}
    return {"lr": engine.get_lr()[0], "loss_scale": engine.optimizer.loss_scale, "adam_steps": adam_steps,
            "global_steps": engine.global_steps, "skipped_steps": engine.skipped_steps}


def _resume(rank: int, world: int, runs: list[tuple]) -> dict:
    """Each run: (fixture, zcore stage or None, its source: 'deepspeed' or a
    converted zcore checkpoint, gradient accumulation steps)."""
    out = {}
    for name, stage, source, gas in runs:
        engine, *_ = zcore.initialize(model=model(seed=7), config=_config(name, world, stage, gas))
        if source == "deepspeed":
            zcore.load_deepspeed_checkpoint(engine, CHECKPOINTS / name / "checkpoint")
        else:
            engine.load_checkpoint(source)
        after_load = _state(engine)
        ds_world = FIXTURES[name][0]
        mine = [r for r in range(ds_world) if r % world == rank]  # DeepSpeed's ranks' batches this rank takes
        out[(name, stage, source)] = {"after_load": after_load, "steps": _continue(engine, mine), "ds_ranks": mine}
        engine.destroy()
    return out


def _same_updates(steps: list[dict], scale_before: float) -> int:
    """How many of DeepSpeed's recorded steps zcore's must give: all, up to
    and including the first one where the loss scale grew. On such a
    step DeepSpeed (0.19.8, ZeRO 1-3) raises the scale before it unscales the
    gradients (``_update_scale`` before ``unscale_and_clip_grads``), so that
    step's gradients are divided by twice the scale that multiplied the loss;
    zcore divides by the scale that multiplied it."""
    for i, step in enumerate(steps):
        if step["loss_scale"] > scale_before:
            return i + 1  # step i's own loss is from before its update
        scale_before = step["loss_scale"]
    return len(steps)


def _check(result: dict, name: str) -> None:
    recorded = _recorded(name)["ranks"]
    for k, ds_rank in enumerate(result["ds_ranks"]):
        expected = recorded[ds_rank]
        loaded = result["after_load"]
        assert loaded["lr"] == pytest.approx(expected["after_load"]["lr"], rel=RELATIVE), name
        assert loaded["loss_scale"] == expected["after_load"]["loss_scale"], name
        assert loaded["adam_steps"] == {expected["after_load"]["adam_step"]}, name
        assert (loaded["global_steps"], loaded["skipped_steps"]) == (
            expected["after_load"]["global_steps"], expected["after_load"]["skipped_steps"]), name
        same_updates = _same_updates(expected["steps"], expected["after_load"]["loss_scale"])
        assert len(result["steps"]) == len(expected["steps"]) == STEPS_AFTER_LOAD
        for i, (mine, theirs) in enumerate(zip(result["steps"], expected["steps"])):
            where = f"{name}, DeepSpeed rank {ds_rank}, step {i} after the load"
            if i == same_updates:
                break  # DeepSpeed's weights differ from here, and what follows from them
            assert mine["losses"][k] == pytest.approx(theirs["loss"], rel=RELATIVE), where
            assert mine["lr"] == pytest.approx(theirs["lr"], rel=RELATIVE), where
            assert mine["loss_scale"] == theirs["loss_scale"], where


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """z2_fp32_offload_ws2, converted by the command."""
    out = tmp_path_factory.mktemp("converted")
    done = subprocess.run(
        [sys.executable, "-m", "zcore.cli", "convert", "--from", "deepspeed",
         str(CHECKPOINTS / "z2_fp32_offload_ws2" / "checkpoint"), str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == out / "global_step8"
    return out


def test_two_ranks_continue_as_deepspeed(converted: Path) -> None:
    """Every 2-rank fixture at its own stage, one at another stage, and the
    converted checkpoint: one set of ranks for all."""
    runs = [(name, None, "deepspeed", 1) for name in SAME_RUN]
    runs += [("z2_bf16_ws2", 3, "deepspeed", 1), ("z3_fp32_ws2", 1, "deepspeed", 1),
             ("z2_fp32_offload_ws2", None, str(converted), 1)]
    results = run_ranks(_resume, 2, runs, timeout=600)
    for name, stage, source, _ in runs:
        for rank_result in results:
            _check(rank_result[(name, stage, source)], name)


def test_other_world_sizes() -> None:
    """A 2-rank checkpoint on 1 rank, and 3-rank ones on 1 rank: each
    DeepSpeed rank's micro-batch is a micro-step of the accumulation window."""
    runs = [("z1_fp32_ws2", 2, "deepspeed", 2), ("z3_fp32_ws3", 3, "deepspeed", 3),
            ("z2_fp16_ws3", 2, "deepspeed", 3)]
    (result,) = run_ranks(_resume, 1, runs, timeout=600, launcher=False)
    for name, stage, source, _ in runs:
        _check(result[(name, stage, source)], name)


def _hostile(path: Path) -> None:
    """Overwrites a DeepSpeed file with a pickle naming a global outside the allow-list."""
    torch.save({"optimizer_state_dict": {"loss_scaler": shutil.rmtree}}, path)


def test_refusals(tmp_path: Path) -> None:
    source = CHECKPOINTS / "z1_fp32_ws2" / "checkpoint"
    copy_dir = tmp_path / "ckpt"
    shutil.copytree(source, copy_dir)
    tag_dir = copy_dir / "global_step8"
    rank1 = tag_dir / "zero_pp_rank_1_mp_rank_00_optim_states.pt"

    (copy_dir / "latest").unlink()
    with pytest.raises(zcore.CheckpointError, match="no 'latest' file.*global_step8"):
        open_checkpoint(copy_dir)
    with pytest.raises(zcore.CheckpointError, match="no directory for tag 'nope'"):
        open_checkpoint(copy_dir, "nope")
    with pytest.raises(zcore.CheckpointError, match="not a DeepSpeed ZeRO checkpoint"):
        open_checkpoint(tmp_path, "ckpt")
    rank1.rename(tmp_path / "aside.pt")
    with pytest.raises(zcore.CheckpointError, match="2 ranks, but the directory holds 1 optimizer files"):
        open_checkpoint(copy_dir, "global_step8")
    _hostile(tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(zcore.CheckpointError, match="holds something other than DeepSpeed's checkpoint state.*never runs code"):
        open_checkpoint(copy_dir, "global_step8")


class _Wider(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 29)
        self.hidden = nn.Linear(29, 30)
        self.out = nn.Linear(30, 5)


def _load_into_wider(rank: int, world: int) -> str:
    engine, *_ = zcore.initialize(model=_Wider(), config=_config("z1_fp32_ws2", world))
    try:
        zcore.load_deepspeed_checkpoint(engine, CHECKPOINTS / "z1_fp32_ws2" / "checkpoint")
    except zcore.CheckpointMismatchError as exc:
        return str(exc)
    return "loaded"


def test_another_model_is_named() -> None:
    (message,) = run_ranks(_load_into_wider, 1, timeout=300, launcher=False)
    assert "hidden.weight: checkpoint [29, 29], model [30, 29]" in message
    assert "out.weight" in message
