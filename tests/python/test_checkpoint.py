"""Sharded checkpoints: resume at another world size, stage or offload setting,
and every piece of training state restored.

The reference is the uninterrupted run: it saves after step 5 and goes on;
runs resumed from that checkpoint at other world sizes must produce the same
losses (fp32, within 1e-6 relative) on the same global batches.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

import zcore
from distributed import run_ranks
from models import forward, global_batch, loss_of, make_model
from training import rows, zcore_config

BATCH = 12  # splits evenly over 1, 2, 3 and 4 ranks
SAVE_AT, STEPS = 5, 10
RELATIVE = 1e-6


def config(stage: int, offload: bool = False, **extra) -> dict:
    return zcore_config(stage, 1, 1.0, offload=offload, train_batch_size=BATCH, **extra)


def train(engine, name: str, rank: int, world: int, steps: range, save_dir=None, save_at=None) -> list[float]:
    losses = []
    for step in steps:
        x, y = global_batch(name, step, BATCH)
        part = rows(rank, world, BATCH)
        loss = loss_of(name, forward(name, engine, x[part], step, rank), y[part])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
        if step + 1 == save_at:
            engine.save_checkpoint(save_dir)
    return losses


def uninterrupted(rank: int, world: int, name: str, cfg: dict, save_dir: str) -> list[float]:
    engine, *_ = zcore.initialize(model=make_model(name), config=cfg)
    return train(engine, name, rank, world, range(STEPS), save_dir, SAVE_AT)


def resumed(rank: int, world: int, name: str, cfg: dict, load_dir: str) -> dict:
    engine, *_ = zcore.initialize(model=make_model(name), config=cfg)
    path, _ = engine.load_checkpoint(load_dir)
    steps_at_load = engine.global_steps
    losses = train(engine, name, rank, world, range(SAVE_AT, STEPS))
    return {"path": str(path), "steps_at_load": steps_at_load, "losses": losses}


def assert_same_losses(got: list[float], ref: list[float], label: str) -> None:
    for step, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert abs(a - b) <= RELATIVE * abs(b), f"{label}: step {SAVE_AT + step} loss {a!r} vs {b!r}"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resumes_at_other_world_sizes(stage: int, tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    ref = run_ranks(uninterrupted, 2, "gpt", config(stage), ckpt)[0]
    assert (tmp_path / "ckpt" / "latest").read_text() == f"global_step{SAVE_AT}"
    for world in (1, 3, 4):
        got = run_ranks(resumed, world, "gpt", config(stage), ckpt, timeout=400)
        assert got[0]["steps_at_load"] == SAVE_AT
        assert_same_losses(got[0]["losses"], ref[SAVE_AT:], f"stage {stage}, 2 -> {world} ranks")


def test_resumes_with_another_stage_and_offload(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    ref = run_ranks(uninterrupted, 2, "gpt", config(1), ckpt)[0]
    got = run_ranks(resumed, 3, "gpt", config(3, offload=True), ckpt)
    assert_same_losses(got[0]["losses"], ref[SAVE_AT:], "stage 1 -> stage 3 with CPU offload")
    # And back: an offloaded (zcore CPU Adam) checkpoint into torch's AdamW on stage 2.
    ckpt2 = str(tmp_path / "ckpt2")
    ref2 = run_ranks(uninterrupted, 2, "gpt", config(3, offload=True), ckpt2)[0]
    got2 = run_ranks(resumed, 1, "gpt", config(2), ckpt2)
    assert_same_losses(got2[0]["losses"], ref2[SAVE_AT:], "stage 3 offload -> stage 2")


def test_resumes_with_parameters_offloaded_and_back(tmp_path: Path) -> None:
    """Stage 3 with parameter shards on the host (frozen ones too, on the model
    with a frozen submodule) saves what the device-only run would, and loads
    into either setting at another world size."""
    host = {"stage3_param_persistence_threshold": 0, "offload_param": {"device": "cpu"}}
    on_host = config(3, offload=True, zero=host)
    on_device = config(3, zero={"stage3_param_persistence_threshold": 0})
    ckpt = str(tmp_path / "ckpt")
    ref = run_ranks(uninterrupted, 2, "mix", on_host, ckpt)[0]
    got = run_ranks(resumed, 3, "mix", on_device, ckpt)
    assert_same_losses(got[0]["losses"], ref[SAVE_AT:], "parameters on host -> on device, 2 -> 3 ranks")
    ckpt2 = str(tmp_path / "ckpt2")
    ref2 = run_ranks(uninterrupted, 2, "mix", on_device, ckpt2)[0]
    got2 = run_ranks(resumed, 1, "mix", on_host, ckpt2)
    assert_same_losses(got2[0]["losses"], ref2[SAVE_AT:], "parameters on device -> on host, 2 -> 1 rank")


def test_resumes_with_states_on_nvme_and_back(tmp_path: Path) -> None:
    """Parameters and optimizer states on NVMe (the model with a frozen
    submodule, sub-groups smaller than its units) save what an in-memory run
    would: a checkpoint goes from NVMe at 2 ranks to the device at 3, and
    from the host at 2 ranks to NVMe at 1 (in-memory master, NVMe
    parameters), then on NVMe at 3 ranks again."""
    nvme = {"device": "nvme", "nvme_path": str(tmp_path / "swap")}
    params_on_nvme = {**nvme, "max_in_cpu": 0}  # every shard (by default the first 1e9 elements stay on the host)
    (tmp_path / "swap").mkdir()
    on_nvme = config(3, zero={"stage3_param_persistence_threshold": 0, "sub_group_size": 700,
                              "offload_param": params_on_nvme, "offload_optimizer": nvme})
    params_nvme = config(3, offload=True, zero={"stage3_param_persistence_threshold": 0,
                                                "offload_param": params_on_nvme})
    on_device = config(3, zero={"stage3_param_persistence_threshold": 0})
    ckpt = str(tmp_path / "ckpt")
    ref = run_ranks(uninterrupted, 2, "mix", on_nvme, ckpt)[0]
    got = run_ranks(resumed, 3, "mix", on_device, ckpt)
    assert_same_losses(got[0]["losses"], ref[SAVE_AT:], "states on NVMe -> on device, 2 -> 3 ranks")
    got = run_ranks(resumed, 3, "mix", on_nvme, ckpt)
    assert_same_losses(got[0]["losses"], ref[SAVE_AT:], "states on NVMe -> on NVMe, 2 -> 3 ranks")
    ckpt2 = str(tmp_path / "ckpt2")
    ref2 = run_ranks(uninterrupted, 2, "mix", config(3, offload=True), ckpt2)[0]
    got2 = run_ranks(resumed, 1, "mix", params_nvme, ckpt2)
    assert_same_losses(got2[0]["losses"], ref2[SAVE_AT:], "host -> parameters on NVMe, 2 -> 1 rank")
    got2 = run_ranks(resumed, 1, "mix", on_nvme, ckpt2)
    assert_same_losses(got2[0]["losses"], ref2[SAVE_AT:], "host -> states on NVMe, 2 -> 1 rank")
    # full_state_dict reads the states where they rest: the same values either way.
    from_nvme = run_ranks(full_state_after_load, 2, "mix", on_nvme, ckpt)[0]
    from_device = run_ranks(full_state_after_load, 2, "mix", on_device, ckpt)[0]
    assert from_nvme.keys() == from_device.keys()
    for key, value in from_device.items():
        assert torch.equal(from_nvme[key], value), key


def full_state_after_load(rank: int, world: int, name: str, cfg: dict, load_dir: str) -> dict:
    engine, *_ = zcore.initialize(model=make_model(name), config=cfg)
    engine.load_checkpoint(load_dir)
    state = engine.full_state_dict()
    engine.destroy()
    return state


def state_at_save_and_load(rank: int, world: int, save_cfg: dict, load_cfg: dict, ckpt: str, phase: str) -> dict:
    """Phase "save": trains the NormMLP (buffers, frozen layer) 3 steps,
    saves, returns the full state. Phase "load": returns the full state
    right after loading into a fresh engine of ``load_cfg``."""
    cfg = save_cfg if phase == "save" else load_cfg
    engine, *_ = zcore.initialize(model=make_model("norm"), config=cfg)
    if phase == "save":
        train(engine, "norm", rank, world, range(3))
        engine.save_checkpoint(ckpt, tag="norm")
    else:
        engine.load_checkpoint(ckpt, tag="norm")
    state = engine.full_state_dict()
    with zcore.GatheredParameters(list(engine.module.parameters())):
        live = {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}
    return {"full": state, "live": live}


@pytest.mark.parametrize(("save_stage", "load_stage", "load_world"), [(3, 2, 2), (2, 3, 3), (1, 0, 1)])
def test_frozen_parameters_and_buffers_are_restored(
    save_stage: int, load_stage: int, load_world: int, tmp_path: Path
) -> None:
    ckpt = str(tmp_path / "ckpt")
    saved = run_ranks(state_at_save_and_load, 2, config(save_stage), None, ckpt, "save")[0]["full"]
    assert saved["norm.num_batches_tracked"].item() == 3  # the buffers did change
    loaded = run_ranks(state_at_save_and_load, load_world, None, config(load_stage), ckpt, "load")
    assert loaded[0]["full"].keys() == saved.keys()
    for key, value in saved.items():
        assert torch.equal(loaded[0]["full"][key], value), key
    for rank_state in loaded:  # every rank's live module has the values
        for key, value in saved.items():
            assert torch.equal(rank_state["live"][key], value.float()), key


def training_state_round_trip(rank: int, world: int, ckpt: str, phase: str) -> dict:
    cfg = config(
        2,
        fp16={"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2},
        scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": 1e-2}},
    )
    engine, *_ = zcore.initialize(model=make_model("gpt"), config=cfg)
    client = None
    if phase == "save":
        train(engine, "gpt", rank, world, range(4))
        random.seed(7 + rank)
        np.random.seed(11 + rank)
        torch.manual_seed(13 + rank)
        engine.save_checkpoint(ckpt, client_state={"epoch": 3, "ids": torch.arange(4), "nested": [{"a": 1.5}]})
    else:
        _, client = engine.load_checkpoint(ckpt)
    pieces = [p for g in engine.optimizer.param_groups for p in g["params"]]
    return {
        "counters": (engine.global_steps, engine.global_samples, engine.micro_steps, engine.skipped_steps),
        "loss_scale": engine.loss_scale,
        "scaler": engine.optimizer.precision.scaler.state_dict(),
        "lr": engine.get_lr(),
        "scheduler": engine.lr_scheduler.state_dict(),
        "rng": (random.random(), float(np.random.rand()), torch.rand(3)),
        "adam": [{k: v.clone() for k, v in engine.optimizer.state[p].items()} for p in pieces],
        "client": client,
    }


def test_training_state_is_restored(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    saved = run_ranks(training_state_round_trip, 2, ckpt, "save")
    loaded = run_ranks(training_state_round_trip, 2, ckpt, "load")
    for rank in range(2):
        s, got = saved[rank], loaded[rank]
        for key in ("counters", "loss_scale", "scaler", "lr", "scheduler"):
            assert got[key] == s[key], key
        assert got["rng"][:2] == s["rng"][:2] and torch.equal(got["rng"][2], s["rng"][2])
        assert len(got["adam"]) == len(s["adam"])
        for a, b in zip(got["adam"], s["adam"]):
            assert a.keys() == b.keys()
            for k in a:
                assert torch.equal(a[k], b[k]), k
        assert got["client"]["epoch"] == 3 and got["client"]["nested"] == [{"a": 1.5}]
        assert torch.equal(got["client"]["ids"], torch.arange(4))
    assert saved[0]["rng"][:2] != saved[1]["rng"][:2]  # per-rank states, not one copy


def test_weights_are_readable_without_optimizer_files(tmp_path: Path) -> None:
    """fp32 weights live apart from optimizer states: consolidation reads
    only the weights files."""
    ckpt = tmp_path / "ckpt"
    run_ranks(uninterrupted, 2, "gpt", config(3), str(ckpt))
    tag = ckpt / f"global_step{SAVE_AT}"
    for f in tag.glob("state-*.safetensors"):
        f.unlink()
    files = zcore.checkpoint.consolidate(ckpt, tmp_path / "out", progress=False)
    assert [f.name for f in files] == ["model.safetensors"]


class StepCounting(torch.optim.Optimizer):
    """An optimizer whose state is scalars only (DeepSpeed's test
    HybridStateOptimizer): a count as an int and as a one-element tensor."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["integer_step"], state["tensor_step"] = 0, torch.zeros(1)
                p.add_(p.grad, alpha=-group["lr"] / (1 + state["integer_step"]))
                state["integer_step"] += 1
                state["tensor_step"] += 1


def scalar_states(rank: int, world: int, stage: int, ckpt: str, phase: str) -> dict:
    model = make_model("mlp")
    cfg = {**config(stage), "zero_allow_untested_optimizer": True}
    del cfg["optimizer"]  # given as an object
    engine, *_ = zcore.initialize(model=model, optimizer=StepCounting(p for p in model.parameters() if p.requires_grad),
                                  config=cfg)
    if phase == "load":
        engine.load_checkpoint(ckpt)
        loaded = [(s["integer_step"], s["tensor_step"].tolist()) for s in engine.optimizer.state.values()]
        losses = train(engine, "mlp", rank, world, range(2, 3))
    else:
        loaded = None
        losses = train(engine, "mlp", rank, world, range(3), save_dir=ckpt, save_at=2)
    return {"loaded": loaded, "losses": losses,
            "state": [(s["integer_step"], s["tensor_step"].tolist()) for s in engine.optimizer.state.values()]}


@pytest.mark.parametrize("stage", [1, 3])
def test_an_optimizer_whose_state_is_scalars_only_resumes(stage: int, tmp_path: Path) -> None:
    """Its state is restored (not left empty for the step to start again
    from its first), and the resumed step matches the uninterrupted one."""
    ckpt = str(tmp_path / "ckpt")
    whole = run_ranks(scalar_states, 2, stage, ckpt, "save")
    resumed_run = run_ranks(scalar_states, 2, stage, ckpt, "load")
    for rank in range(2):
        assert resumed_run[rank]["loaded"] and all(s == (2, [2.0]) for s in resumed_run[rank]["loaded"])
        assert resumed_run[rank]["state"] == whole[rank]["state"]
        assert resumed_run[rank]["losses"] == pytest.approx(whole[rank]["losses"][2:], rel=1e-6)
