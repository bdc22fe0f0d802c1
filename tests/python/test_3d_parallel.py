"""zcore in all three dimensions at once: world 8 as a DeviceMesh of
2 "pp" x 2 "dp" x 2 "tp". The GPT is cut into two pipeline stages as in
tests/python/test_pipeline_parallel.py, each stage's MLP is split
Megatron-style over "tp" as in tests/python/test_tensor_parallel.py, and
zcore shards each stage over its dp group.

The reference is single-process torch AdamW on the whole model over the
same global batches (dp rank d's micro-batch m is part m x 2 + d; the tp
ranks of a dp rank compute the same part). Losses at every step and the
final parameters (DTensors joined over tp) agree within 1e-5 at ZeRO
stages 1-3, with clipping (the norm summed over stages, tp slices and dp
shards), the LM head tied to the embedding across stages.
A checkpoint resumes bit-exact and consolidates to the trained weights.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import zcore
from distributed import run_ranks
from test_pipeline_parallel import CLIP, assert_matches_reference, pipelined_steps, stage_module
from test_tensor_parallel import whole_params
from models import global_batch
from training import ON_DEMAND, zcore_config
from zcore.checkpoint.consolidate import consolidate
from zcore.demo.gpt import lm_loss
from zcore.pipelining import PipelineStage

WORLD, PP, DP, TP = 8, 2, 2, 2
GAS = 2  # micro-batches per step: a global batch of 8 is 2 dp x 2 micro-batches x 2 rows
STEPS = 20
TOLERANCE = 1e-5

# (label, ZeRO stage, schedule, clipping, more zero_optimization keys, LM head tied)
VARIANTS = [
    ("stage 1, 1F1B, clipped, tied", 1, Schedule1F1B, CLIP, {}, True),
    ("stage 2, GPipe, tied", 2, ScheduleGPipe, 0.0, {}, True),
    ("stage 3, 1F1B, clipped, tied", 3, Schedule1F1B, CLIP, ON_DEMAND, True),
]


def engine_3d(zero_stage: int, schedule_type=Schedule1F1B, clip: float = 0.0, zero=None, tied: bool = False):
    mesh = init_device_mesh("cpu", (PP, DP, TP), mesh_dim_names=("pp", "dp", "tp"))
    stage = mesh["pp"].get_local_rank()
    module, ties = stage_module(stage, tied)
    block = "blocks.0" if stage == 0 else "blocks.1"
    parallelize_module(module, mesh["tp"], {f"{block}.c_fc": ColwiseParallel(), f"{block}.c_out": RowwiseParallel()})
    engine, *_ = zcore.initialize(model=module, config=zcore_config(zero_stage, GAS, clip, zero=zero),
                                  device_mesh=mesh, tied_parameters=ties)
    schedule = schedule_type(PipelineStage(engine, stage, PP), n_microbatches=GAS, loss_fn=lm_loss)
    return engine, schedule, mesh


def train(rank: int, world: int, zero_stage: int, schedule_type, clip: float, zero: dict, tied: bool) -> dict:
    engine, schedule, mesh = engine_3d(zero_stage, schedule_type, clip, zero, tied)
    losses = pipelined_steps(engine, schedule, mesh, range(STEPS))
    result = {"losses": losses, "params": whole_params(engine), "global_steps": engine.global_steps}
    engine.destroy()
    return result


@pytest.mark.parametrize("label, zero_stage, schedule_type, clip, zero, tied", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_pp_x_dp_x_tp_matches_single_process_adamw(label, zero_stage, schedule_type, clip, zero, tied):
    results = run_ranks(train, WORLD, zero_stage, schedule_type, clip, zero, tied, timeout=300)
    assert_matches_reference(label, results, clip, tied)


def save_and_resume(rank: int, world: int, directory: str) -> dict:
    """Stage 2: 10 steps, a checkpoint, 10 more; a new engine loads the
    checkpoint and trains the same 10 again."""
    engine, schedule, mesh = engine_3d(2)
    pipelined_steps(engine, schedule, mesh, range(10))
    engine.save_checkpoint(directory, tag="ten")
    saved = whole_params(engine)
    after = pipelined_steps(engine, schedule, mesh, range(10, 20))
    engine.destroy()
    engine, schedule, mesh = engine_3d(2)
    engine.load_checkpoint(directory, tag="ten")
    resumed = pipelined_steps(engine, schedule, mesh, range(10, 20))
    engine.destroy()
    return {"saved": saved, "after": after, "resumed": resumed}


def test_checkpoints_resume_and_consolidate(tmp_path):
    directory = str(tmp_path / "checkpoints")
    results = run_ranks(save_and_resume, WORLD, directory, timeout=300)
    last = results[-1]
    assert last["resumed"] == last["after"]  # the same layout: bit-exact
    files = consolidate(directory, tmp_path / "whole", tag="ten", progress=False)
    whole = {}
    for f in files:
        whole.update(load_file(f))
    saved = {name: value for r in results for name, value in r["saved"].items()}
    assert whole.keys() == saved.keys()
    for name, value in saved.items():
        assert torch.equal(whole[name], value), name


def step_records(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (PP, DP, TP), mesh_dim_names=("pp", "dp", "tp"))
    stage = mesh["pp"].get_local_rank()
    module, _ = stage_module(stage)
    config = zcore_config(1, GAS, 0.0, wall_clock_breakdown=True)
    engine, *_ = zcore.initialize(model=module, config=config, device_mesh=mesh)
    schedule = Schedule1F1B(PipelineStage(engine, stage, PP), n_microbatches=GAS, loss_fn=lm_loss)
    x, y = global_batch("gpt", 0, engine.train_batch_size())
    rows_here = x.shape[0] // DP
    micro: list = []
    if stage == 0:
        # Contiguous: torch 2.11's pipelining refuses an input whose strides
        # are not a contiguous tensor's (these token rows are a slice).
        schedule.step(x[:rows_here].contiguous())
    else:
        schedule.step(target=y[:rows_here], losses=micro)
    record = engine.observation.metrics.last
    engine.destroy()
    return {
        "stage": stage,
        "loss": record.loss,
        "micro": torch.stack(micro).mean().item() if micro else None,
        "tokens": None if record.tokens_per_second is None else record.tokens_per_second * record.time_ms["total"] / 1e3,
        "expected_tokens": x.numel(),
    }


def test_step_records_count_the_global_batch_and_the_last_stage_loss():
    for r in run_ranks(step_records, WORLD, timeout=120):
        if r["stage"] == 0:  # token ids come in here: this rank's times the dp ranks (not the tp ranks too)
            assert r["tokens"] == pytest.approx(r["expected_tokens"], rel=1e-6) and r["loss"] is None
        else:  # activations come in: no tokens; the losses are the schedule's
            assert r["tokens"] is None and r["loss"] == pytest.approx(r["micro"], rel=1e-6)
