"""Writes the DeepSpeed checkpoints test_deepspeed_checkpoint loads, and
what DeepSpeed's own continuation from each gives.

Run it where DeepSpeed 0.19.8 is installed (on the CPU: no compiled ops),
from the repository root, outside zcore's environment:

    python3 -m venv /tmp/venv-ds && /tmp/venv-ds/bin/pip install torch==2.13.0 numpy
    DS_BUILD_OPS=0 /tmp/venv-ds/bin/pip install deepspeed==0.19.8
    DS_ACCELERATOR=cpu PYTHONPATH=tests/python /tmp/venv-ds/bin/python \
        tests/python/data/deepspeed_checkpoints/make_checkpoints.py [NAME ...]

For each fixture of deepspeed_fixtures.FIXTURES, on its number of gloo
ranks: trains deepspeed_fixtures.TinyMLP for STEPS_BEFORE_SAVE steps,
saves a checkpoint to NAME/checkpoint, then builds a fresh engine (other
initial weights), loads the checkpoint and trains STEPS_AFTER_LOAD more
steps on the same data, recording into NAME/continuation.json each rank's
losses and, after the load and after each step, the learning rate, the
loss scale and Adam's step count. The recovery script DeepSpeed copies into
every checkpoint (zero_to_torch.py) is removed: it is no part of the state.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import socket
import sys

import deepspeed
import torch

from deepspeed_fixtures import CHECKPOINTS, FIXTURES, STEPS_AFTER_LOAD, STEPS_BEFORE_SAVE, TAG, batch, loss_of, model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine(config: dict, seed: int):
    engine, _, _, _ = deepspeed.initialize(model=model(seed), config=config, model_parameters=None)
    return engine


def _adam_step(engine) -> float:
    steps = {float(s["step"]) for s in engine.basic_optimizer.state.values() if "step" in s}
    if len(steps) != 1:
        raise RuntimeError(f"expected one Adam step count, found {steps}")
    return steps.pop()


def _loss_scale(engine) -> float:
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    return float(scaler.cur_scale) if scaler is not None else 1.0


def _train_step(engine, step: int, rank: int) -> float:
    x, y = batch(step, rank)
    dtype = next(engine.module.parameters()).dtype
    loss = loss_of(engine(x.to(dtype)), y)
    engine.backward(loss)
    engine.step()
    return loss.item()


def _snapshot(engine) -> dict:
    return {"lr": engine.get_lr()[0], "loss_scale": _loss_scale(engine), "adam_step": _adam_step(engine),
            "global_steps": engine.global_steps, "skipped_steps": engine.skipped_steps}


def _rank(rank: int, world_size: int, port: int, name: str, results) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    _, config = FIXTURES[name]
    config = dict(config, train_batch_size=config["train_micro_batch_size_per_gpu"] * world_size)
    save_dir = CHECKPOINTS / name / "checkpoint"
    engine = _engine(config, seed=0)
    before = [_train_step(engine, step, rank) for step in range(STEPS_BEFORE_SAVE)]
    saved = _snapshot(engine)
    engine.save_checkpoint(str(save_dir), tag=TAG)
    engine.destroy()
    del engine
    resumed = _engine(config, seed=1)
    resumed.load_checkpoint(str(save_dir))
    after_load = _snapshot(resumed)
    steps = []
    for step in range(STEPS_BEFORE_SAVE, STEPS_BEFORE_SAVE + STEPS_AFTER_LOAD):
        loss = _train_step(resumed, step, rank)
        steps.append(dict(_snapshot(resumed), loss=loss))
    results.put((rank, {"config": config, "losses_before_save": before, "at_save": saved, "after_load": after_load, "steps": steps}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def make(name: str) -> None:
    world_size, _ = FIXTURES[name]
    shutil.rmtree(CHECKPOINTS / name, ignore_errors=True)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world_size, port, name, results)) for r in range(world_size)]
    for p in procs:
        p.start()
    by_rank = dict(results.get(timeout=600) for _ in range(world_size))
    for p in procs:
        p.join(timeout=60)
        if p.exitcode != 0:
            raise RuntimeError(f"{name}: rank {procs.index(p)} exited with {p.exitcode}")
    for script in (CHECKPOINTS / name / "checkpoint").glob("*.py"):
        script.unlink()
    configs = [by_rank[r].pop("config") for r in range(world_size)]
    record = {
        "deepspeed": deepspeed.__version__,
        "torch": torch.__version__,
        "world_size": world_size,
        "config": configs[0],
        "ranks": [by_rank[r] for r in range(world_size)],
    }
    (CHECKPOINTS / name / "continuation.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"{name}: written", flush=True)


if __name__ == "__main__":
    for fixture in sys.argv[1:] or FIXTURES:
        make(fixture)
