"""zcore under torch's pipeline parallelism (zcore.parallel.pipelining): world 4 as a
DeviceMesh of 2 "pp" x 2 "dp". The GPT is cut into two stages (embeddings
and block 0; block 1, final norm and LM head), each sharded by zcore over
its dp group, and torch's schedules (1F1B, GPipe) run 2 micro-batches per
step, one zcore micro-step each.

The GPT keeps its LM head tied to its token embedding (but in two
variants, untied in the reference too): each stage holds a copy (the first
its embedding, the last its head), named "embedding" in
zcore.initialize(tied_parameters=...), and zcore sums the copies'
gradients before each step.

The reference is single-process torch AdamW on the whole model (tied as
the run) over the same global batches: dp rank d's micro-batch m is part m x 2 + d
of each global batch (tests/python/training.py). Losses at every step and
the final parameters agree within 1e-5 at ZeRO stages 0-3, with clipping
(the norm is summed over both stages) at a threshold every step exceeds.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

import zcore
from distributed import run_ranks
from models import global_batch, make_model
from training import LR, ON_DEMAND, TIGHT, WEIGHT_DECAY, relative_error, rows, zcore_config
from zcore.demo.gpt import lm_loss
from zcore.checkpoint.consolidate import consolidate
from zcore.errors import CheckpointError, ConfigError
from zcore.pipelining import PipelineStage

WORLD, PP, DP = 4, 2, 2
GAS = 2  # micro-batches per step at 2 dp ranks
MICRO = 2  # rows per micro-batch: a global batch of 8 is 2 dp x 2 micro-batches x 2 rows
STEPS = 20
TOLERANCE = 1e-5
CLIP = 0.05  # under every step's gradient norm: every step clips

# (label, ZeRO stage, schedule, clipping, more zero_optimization keys, LM head tied)
VARIANTS = [
    ("stage 0, 1F1B, tied", 0, Schedule1F1B, 0.0, {}, True),
    ("stage 1, 1F1B, clipped, tied", 1, Schedule1F1B, CLIP, {}, True),
    ("stage 2, GPipe, clipped, tied", 2, ScheduleGPipe, CLIP, {}, True),
    ("stage 2, 1F1B, untied", 2, Schedule1F1B, 0.0, {}, False),
    ("stage 3, 1F1B, clipped, tied", 3, Schedule1F1B, CLIP, ON_DEMAND, True),
    ("stage 3, GPipe, tight budget", 3, ScheduleGPipe, 0.0, TIGHT, False),
]


def untied_gpt() -> nn.Module:
    model = make_model("gpt")
    model.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone())
    return model


class FirstStage(nn.Module):
    """Its parameters named as in the whole model (blocks.0...), as a checkpoint needs."""

    def __init__(self, gpt: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe = gpt.wte, gpt.wpe
        self.blocks = nn.ModuleDict({"0": gpt.blocks[0]})

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.blocks["0"](self.wte(idx) + self.wpe(pos))


class LastStage(nn.Module):
    def __init__(self, gpt: nn.Module) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({"1": gpt.blocks[1]})
        self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(self.blocks["1"](x)))


def stage_module(stage: int, tied: bool = False) -> tuple[nn.Module, dict]:
    """The stage's module and its tied_parameters (the embedding's copy)."""
    gpt = make_model("gpt") if tied else untied_gpt()
    module = FirstStage(gpt) if stage == 0 else LastStage(gpt)
    copy = module.wte.weight if stage == 0 else module.lm_head.weight
    return module, ({"embedding": copy} if tied else {})


def pipelined_steps(engine, schedule, mesh, steps: range) -> list[float]:
    """``steps`` of the global batches, this dp rank's micro-batches of each
    (part m x dp + d: the reference's split), stacked for the schedule to cut."""
    stage, dp, size = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank(), mesh["dp"].size()
    gas, batch = engine.gradient_accumulation_steps(), engine.train_batch_size()
    tp = dist.get_world_size() // (mesh["pp"].size() * size)
    losses = []
    for step in steps:
        x, y = global_batch("gpt", step, batch)
        parts = [rows(m * size + dp, size * gas, batch) for m in range(gas)]
        if stage == 0:
            schedule.step(torch.cat([x[p] for p in parts]))
            total = torch.zeros(())
        else:
            micro: list = []
            schedule.step(target=torch.cat([y[p] for p in parts]), losses=micro)
            total = torch.stack(micro).sum().detach()
        dist.all_reduce(total)  # the last stage's sums over its dp ranks (and its tp ranks, which hold the same)
        losses.append(total.item() / (size * gas * tp))
    return losses


def pipelined_engine(
    zero_stage: int, pp: int, dp: int, schedule_type=Schedule1F1B, clip: float = 0.0, zero=None, tied: bool = False
):
    mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
    stage = mesh["pp"].get_local_rank()
    gas = 8 // (MICRO * dp)
    module, ties = stage_module(stage, tied)
    engine, *_ = zcore.initialize(model=module, config=zcore_config(zero_stage, gas, clip, zero=zero),
                                  device_mesh=mesh, tied_parameters=ties)
    schedule = schedule_type(PipelineStage(engine, stage, pp), n_microbatches=gas, loss_fn=lm_loss)
    return engine, schedule, mesh


def gathered(engine) -> dict:
    with zcore.GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def train(rank: int, world: int, zero_stage: int, schedule_type, clip: float, zero: dict, tied: bool) -> dict:
    engine, schedule, mesh = pipelined_engine(zero_stage, PP, DP, schedule_type, clip, zero, tied)
    losses = pipelined_steps(engine, schedule, mesh, range(STEPS))
    result = {"losses": losses, "params": gathered(engine), "global_steps": engine.global_steps}
    engine.destroy()
    return result


def reference(clip: float, tied: bool) -> dict:
    model = make_model("gpt") if tied else untied_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses = []
    for step in range(STEPS):
        x, y = global_batch("gpt", step, 8)
        total = 0.0
        for q in range(DP * GAS):
            part = rows(q, DP * GAS, 8)
            loss = lm_loss(model(x[part]), y[part])
            (loss / (DP * GAS)).backward()
            total += loss.item()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(total / (DP * GAS))
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


@pytest.mark.parametrize("label, zero_stage, schedule_type, clip, zero, tied", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_dp_x_pp_matches_single_process_adamw(label, zero_stage, schedule_type, clip, zero, tied):
    results = run_ranks(train, WORLD, zero_stage, schedule_type, clip, zero, tied, timeout=240)
    assert_matches_reference(label, results, clip, tied)


def assert_matches_reference(label: str, results: list[dict], clip: float, tied: bool) -> None:
    """Every rank's losses, and the parameters of every stage (the same on
    each rank holding them), against the single-process reference."""
    ref = reference(clip, tied)
    if tied:  # the whole model names the weight once; the last stage's copy must equal it too
        ref["params"]["lm_head.weight"] = ref["params"]["wte.weight"]
    params = {}
    for rank, got in enumerate(results):
        assert got["global_steps"] == STEPS, f"{label}, rank {rank}"
        for step, (a, b) in enumerate(zip(got["losses"], ref["losses"], strict=True)):
            assert abs(a - b) <= TOLERANCE * abs(b), f"{label}, rank {rank}: step {step} loss {a} vs {b}"
        for name, value in got["params"].items():
            params.setdefault(name, value)
            assert torch.equal(params[name], value), f"{label}: {name} differs across the ranks holding it"
    assert params.keys() == ref["params"].keys()
    for name, value in params.items():
        assert relative_error(value, ref["params"][name]) <= TOLERANCE, f"{label}: parameter {name}"


def save_and_resume(rank: int, world: int, directory: str) -> dict:
    """Stage 2, 2 pp x 2 dp: 10 steps, a checkpoint, 10 more; a new engine
    loads the checkpoint and trains the same 10 again."""
    engine, schedule, mesh = pipelined_engine(2, PP, DP)
    pipelined_steps(engine, schedule, mesh, range(10))
    engine.save_checkpoint(directory, tag="ten")
    saved = gathered(engine)
    after = pipelined_steps(engine, schedule, mesh, range(10, 20))
    engine.destroy()
    engine, schedule, mesh = pipelined_engine(2, PP, DP)
    engine.load_checkpoint(directory, tag="ten")
    resumed = pipelined_steps(engine, schedule, mesh, range(10, 20))
    engine.destroy()
    return {"saved": saved, "after": after, "resumed": resumed}


def resume_unpipelined(rank: int, world: int, directory: str) -> list[float]:
    """World 2, one dp group holding the whole (untied) model, no pipeline."""
    engine, *_ = zcore.initialize(model=untied_gpt(), config=zcore_config(2, 2, 0.0))
    engine.load_checkpoint(directory, tag="ten")
    losses = []
    for step in range(10, 20):
        x, y = global_batch("gpt", step, 8)
        total = torch.zeros(())
        for m in range(2):
            part = rows(m * world + rank, world * 2, 8)
            loss = lm_loss(engine(x[part]), y[part])
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        dist.all_reduce(total)
        losses.append(total.item() / (world * 2))
    engine.destroy()
    return losses


def test_checkpoints_resume_and_load_at_another_layout(tmp_path):
    directory = str(tmp_path / "checkpoints")
    results = run_ranks(save_and_resume, WORLD, directory, timeout=240)
    last = results[-1]  # a last-stage rank holds the losses
    assert last["resumed"] == last["after"]  # the same layout: bit-exact
    for a, b in zip(run_ranks(resume_unpipelined, 2, directory, timeout=240)[0], last["after"], strict=True):
        assert a == pytest.approx(b, rel=TOLERANCE)  # the sums in another order
    one_dp = run_ranks(save_and_resume_elsewhere, 2, directory, timeout=240)[-1]
    for a, b in zip(one_dp, last["after"], strict=True):
        assert a == pytest.approx(b, rel=TOLERANCE)
    files = consolidate(directory, tmp_path / "whole", tag="ten", progress=False)
    whole = {}
    for f in files:
        whole.update(load_file(f))
    saved = {name: value for r in results for name, value in r["saved"].items()}
    assert whole.keys() == saved.keys() == dict(untied_gpt().named_parameters()).keys()
    for name, value in saved.items():
        assert torch.equal(whole[name], value), name


def save_and_resume_elsewhere(rank: int, world: int, directory: str) -> list[float]:
    """World 2 as 2 pp x 1 dp: another data-parallel size."""
    engine, schedule, mesh = pipelined_engine(2, PP, 1)
    engine.load_checkpoint(directory, tag="ten")
    losses = pipelined_steps(engine, schedule, mesh, range(10, 20))
    engine.destroy()
    return losses


def collision(rank: int, world: int, directory: str) -> str:
    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    stage = mesh["pp"].get_local_rank()
    gpt = untied_gpt()
    module = nn.ModuleDict({"block": gpt.blocks[stage]})  # both stages name theirs "block"
    engine, *_ = zcore.initialize(model=module, config=zcore_config(1, GAS, 0.0), device_mesh=mesh)
    try:
        engine.save_checkpoint(directory)
    except CheckpointError as exc:
        return str(exc)
    finally:
        engine.destroy()
    return "saved"


def test_stages_naming_a_tensor_alike_cannot_save(tmp_path):
    for message in run_ranks(collision, WORLD, str(tmp_path), timeout=120):
        assert "stages 0 and 1 both hold a tensor named 'block.ln_1.weight'" in message
    assert not any(tmp_path.iterdir())  # refused before anything was written


def tie_refusals(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    stage = mesh["pp"].get_local_rank()
    refused = {}
    for label, zero_stage, on, foreign in (("one stage", 1, (0,), False), ("not the stage's", 3, (0, 1), True)):
        module, ties = stage_module(stage, tied=True)
        if foreign:
            ties = {"embedding": nn.Parameter(torch.zeros(3))}
        try:
            zcore.initialize(model=module, config=zcore_config(zero_stage, GAS, 0.0), device_mesh=mesh,
                             tied_parameters=ties if stage in on else {})
        except ConfigError as exc:
            refused[label] = str(exc)
    return refused


def test_ties_zcore_cannot_honour_are_refused():
    for refused in run_ranks(tie_refusals, WORLD, timeout=120):
        assert "tied_parameters['embedding'] is given on stage 0 only" in refused["one stage"]
        assert "is not a trained parameter of the stage's model" in refused["not the stage's"]


def mismatched(rank: int, world: int) -> str:
    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    stage = mesh["pp"].get_local_rank()
    engine, *_ = zcore.initialize(model=stage_module(stage)[0], config=zcore_config(1, GAS, 0.0), device_mesh=mesh)
    schedule = Schedule1F1B(PipelineStage(engine, stage, PP), n_microbatches=2 * GAS, loss_fn=lm_loss)
    try:
        pipelined_steps(engine, schedule, mesh, range(1))
    except ConfigError as exc:
        return str(exc)
    finally:
        engine.destroy()
    return "accepted"


def test_a_schedule_of_other_micro_batches_than_the_accumulation_is_refused():
    messages = run_ranks(mismatched, WORLD, timeout=120)
    for message in messages:
        assert "runs 4 micro-batches per step but gradient_accumulation_steps is 2" in message


def stage_without_parameters(rank: int, world: int) -> str:
    mesh = init_device_mesh("cpu", (3, 1), mesh_dim_names=("pp", "dp"))
    module, _ = stage_module(0)
    if rank == 1:
        module = nn.Tanh()  # torch's pipelining takes such a stage
    elif rank == 2:
        module, _ = stage_module(1)
    try:
        zcore.initialize(model=module, config=zcore_config(1, 1, 0.0), device_mesh=mesh)
    except ConfigError as exc:
        return str(exc)
    return "initialized"


def test_a_stage_without_parameters_is_refused_on_every_rank():
    said = run_ranks(stage_without_parameters, 3, timeout=120)
    assert "this pipeline stage has no parameter that requires grad" in said[1]
    assert all("failed on rank 1" in s and "no parameter that requires grad" in s for s in (said[0], said[2]))
