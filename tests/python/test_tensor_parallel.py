"""zcore composed with torch's tensor parallelism (zcore.parallel.mesh):
world 4 as a DeviceMesh of 2 "dp" x 2 "tp". Each block's MLP of the tied
GPT is split Megatron-style with ``parallelize_module`` (c_fc column-wise,
c_out row-wise: DTensor parameters sharded over "tp"); the rest of the model
is plain and the same on both tp ranks. zcore shards over "dp" only.

The reference is single-process torch AdamW on the whole model over the
same global batches (tests/python/training.py): dp rank d computes part
m x 2 + d of each global batch, the tp ranks of a dp rank the same part.
Losses at every step and the final parameters (DTensors gathered whole)
agree within 1e-5, with gradient accumulation and with clipping at a
threshold every step exceeds, so the global norm (tp-sharded slices summed
over tp, replicated parameters counted once) is what scales the update.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import zcore
from distributed import run_ranks
from models import forward, global_batch, loss_of, make_model
from test_estimate import assert_close
from training import ON_DEMAND, TIGHT, assert_matches, rows, train_reference, zcore_config
from zcore.checkpoint.consolidate import consolidate
from zcore.errors import ConfigError, InvalidStateError

WORLD, DP, TP = 4, 2, 2
STEPS = 20
TOLERANCE = 1e-5
CLIP = 0.05  # under every step's gradient norm: every step clips

# (label, stage, accumulation steps, clipping, optimizer on the host, more zero_optimization keys)
VARIANTS = [
    ("stage 0", 0, 1, 0.0, False, {}),
    ("stage 1, clipped", 1, 1, CLIP, False, {}),
    ("stage 2, accumulation, clipped", 2, 2, CLIP, False, {}),
    ("stage 2, optimizer on the host", 2, 1, 0.0, True, {}),
    ("stage 3, accumulation, clipped", 3, 2, CLIP, False, ON_DEMAND),
    ("stage 3, tight budget, parameters on the host", 3, 1, 0.0, True, {**TIGHT, "offload_param": {"device": "cpu"}}),
]


def mesh():
    return init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))


def tensor_parallel_gpt(device_mesh) -> torch.nn.Module:
    model = make_model("gpt")
    plan = {}
    for i in range(len(model.blocks)):
        plan[f"blocks.{i}.c_fc"] = ColwiseParallel()
        plan[f"blocks.{i}.c_out"] = RowwiseParallel()
    return parallelize_module(model, device_mesh["tp"], plan)


def train(rank: int, world: int, stage: int, gas: int, clip: float, offload: bool, zero: dict) -> dict:
    device_mesh = mesh()
    model = tensor_parallel_gpt(device_mesh)
    config = zcore_config(stage, gas, clip, offload=offload, zero=zero)
    estimate = zcore.estimate_memory(tensor_parallel_gpt(device_mesh), config, DP, device="cpu")
    engine, *_ = zcore.initialize(model=model, config=config, device_mesh=device_mesh)
    assert engine.train_batch_size() == config["train_batch_size"]
    losses = train_steps(engine, device_mesh, range(STEPS))
    assert_close(estimate, engine.memory_report(), f"rank {rank}")  # this rank's slices, sharded over dp
    params = whole_params(engine)
    sharded = sorted(name for name, p in engine.module.named_parameters() if isinstance(p, DTensor))
    engine.destroy()
    return {"losses": losses, "params": params, "dtensors": sharded}


@pytest.mark.parametrize("label, stage, gas, clip, offload, zero", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_dp_x_tp_matches_single_process_adamw(label, stage, gas, clip, offload, zero):
    results = run_ranks(train, WORLD, stage, gas, clip, offload, zero, timeout=240)
    assert results[0]["dtensors"] == [
        f"blocks.{i}.{layer}.{kind}" for i in range(2) for layer in ("c_fc", "c_out") for kind in ("bias", "weight")
    ]
    reference = train_reference("gpt", clip, STEPS, DP, gas)
    for rank, got in enumerate(results):
        assert_matches(got, reference, TOLERANCE, f"{label}, rank {rank}")


def mesh_of(dp: int, tp: int):
    if tp == 1:
        return init_device_mesh("cpu", (dp,), mesh_dim_names=("dp",))
    return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))


def train_steps(engine, device_mesh, steps: range) -> list[float]:
    """``steps`` of the global batches on this rank's parts (as ``train``)."""
    dp_mesh = device_mesh["dp"]
    dp, size = dp_mesh.get_local_rank(), dp_mesh.size()
    gas, batch = engine.gradient_accumulation_steps(), engine.train_batch_size()
    losses = []
    for step in steps:
        x, y = global_batch("gpt", step, batch)
        total = torch.zeros(())
        for m in range(gas):
            part = rows(m * size + dp, size * gas, batch)
            loss = loss_of("gpt", forward("gpt", engine, x[part], step, dp), y[part])
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        dist.all_reduce(total, group=dp_mesh.get_group())
        losses.append(total.item() / (size * gas))
    return losses


def whole_params(engine) -> dict:
    """Every parameter whole (stage 3: gathered over dp; DTensors: over tp)."""
    with zcore.GatheredParameters(list(engine.module.parameters())):
        return {
            name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone()
            for name, p in engine.module.named_parameters()
        }


def parallel_engine(dp: int, tp: int, gas: int):
    device_mesh = mesh_of(dp, tp)
    model = tensor_parallel_gpt(device_mesh) if tp > 1 else make_model("gpt")
    engine, *_ = zcore.initialize(model=model, config=zcore_config(2, gas, CLIP), device_mesh=device_mesh)
    return engine, device_mesh


def save_and_resume(rank: int, world: int, directory: str) -> dict:
    """Stage 2, 2 dp x 2 tp: 10 steps, a checkpoint, 10 more; then a new
    engine loads the checkpoint and trains the same 10 again."""
    engine, device_mesh = parallel_engine(DP, TP, 1)
    train_steps(engine, device_mesh, range(10))
    engine.save_checkpoint(directory, tag="ten")
    saved = whole_params(engine)
    after = train_steps(engine, device_mesh, range(10, 20))
    engine.destroy()
    engine, device_mesh = parallel_engine(DP, TP, 1)
    engine.load_checkpoint(directory, tag="ten")
    resumed = train_steps(engine, device_mesh, range(10, 20))
    engine.destroy()
    return {"saved": saved, "after": after, "resumed": resumed}


def load_elsewhere(rank: int, world: int, directory: str, tp: int, tag: str, save_as: str | None = None) -> list[float]:
    """Another layout of ``world`` ranks as (world / tp) dp x ``tp`` tp
    loads ``tag`` (first saving it again as ``save_as``), then trains."""
    engine, device_mesh = parallel_engine(world // tp, tp, 2 if world // tp == 1 else 1)
    engine.load_checkpoint(directory, tag=tag)
    if save_as is not None:
        engine.save_checkpoint(directory, tag=save_as)
    resumed = train_steps(engine, device_mesh, range(10, 20))
    engine.destroy()
    return resumed


def test_checkpoints_resume_at_any_dp_size_and_consolidate(tmp_path):
    directory = str(tmp_path / "checkpoints")
    first = run_ranks(save_and_resume, WORLD, directory, timeout=240)[0]
    assert first["resumed"] == first["after"]  # the same ranks and layout: bit-exact
    # Another dp size; another tp size (the parts recut: 2 -> 4, 2 -> none,
    # and none -> 2 from a checkpoint the untensor-parallel engine saved).
    for world, tp, tag, save_as in ((2, 2, "ten", None), (4, 4, "ten", None), (2, 1, "ten", "plain"),
                                    (2, 2, "plain", None)):
        resumed = run_ranks(load_elsewhere, world, directory, tp, tag, save_as, timeout=240)[0]
        for a, b in zip(resumed, first["after"], strict=True):
            assert a == pytest.approx(b, rel=TOLERANCE), (world, tp, tag)  # the sums in another order
    assert "@tp" not in (tmp_path / "checkpoints" / "plain" / "meta.json").read_text()
    files = consolidate(directory, tmp_path / "whole", tag="ten", progress=False)
    whole = {}
    for f in files:
        whole.update(load_file(f))
    assert whole.keys() == first["saved"].keys() | {"lm_head.weight"}  # the tied head under its own key too
    for name, value in first["saved"].items():
        assert torch.equal(whole[name], value), name


def refusals(rank: int, world: int) -> dict:
    device_mesh = mesh()
    refused = {}
    for label, zero in (
        ("parameters on NVMe", {"offload_param": {"device": "nvme", "nvme_path": "/tmp"}}),
        ("qgZ", {"zero_quantized_gradients": True}),
    ):
        try:
            zcore.initialize(model=tensor_parallel_gpt(device_mesh), config=zcore_config(3, 1, 0.0, zero=zero),
                             device_mesh=device_mesh)
        except ConfigError as exc:
            refused[label] = str(exc)
    with torch.device("meta"):
        on_meta = make_model("gpt")
    try:
        zcore.initialize(model=on_meta, config=zcore_config(3, 1, 0.0), device_mesh=device_mesh)
    except ConfigError as exc:
        refused["meta"] = str(exc)
    renamed = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "sp"))
    try:
        zcore.initialize(model=make_model("gpt"), config=zcore_config(1, 1, 0.0), device_mesh=renamed)
    except ConfigError as exc:
        refused["unknown dimension"] = str(exc)
    engine, *_ = zcore.initialize(model=tensor_parallel_gpt(device_mesh), config=zcore_config(1, 1, 0.0),
                                  device_mesh=device_mesh)
    try:
        engine.full_state_dict()
    except InvalidStateError as exc:
        refused["full state dict"] = str(exc)
    engine.destroy()
    on_dp = make_model("gpt")
    parallelize_module(on_dp, device_mesh["dp"], {"blocks.0.c_fc": ColwiseParallel()})
    try:
        zcore.initialize(model=on_dp, config=zcore_config(1, 1, 0.0), device_mesh=device_mesh)
    except ConfigError as exc:
        refused["parallel over dp"] = str(exc)
    return refused


def test_what_does_not_compose_yet_is_refused_by_name():
    for refused in run_ranks(refusals, WORLD, timeout=120):
        assert "offload_param.device = 'nvme'" in refused["parameters on NVMe"]
        assert "meta device" in refused["meta"]
        assert "zero_quantized_gradients" in refused["qgZ"]
        assert "'sp'" in refused["unknown dimension"] and "\"tp\"" in refused["unknown dimension"]
        assert "full_state_dict" in refused["full state dict"] and "zcore consolidate" in refused["full state dict"]
        assert "blocks.0.c_fc.weight" in refused["parallel over dp"] and "device_mesh[\"tp\"]" in refused["parallel over dp"]
