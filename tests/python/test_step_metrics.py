"""Per-step metrics (zcore.observe.step_metrics) and the monitors that write them
(zcore.observe.monitors): each figure against an independent reference."""

from __future__ import annotations

import csv
import logging
import math
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import zcore
from distributed import run_ranks

V, D, H = 50, 16, 24  # vocabulary, embedding, hidden


class TokenMLP(nn.Module):
    """Token ids -> logits through two Linear layers: FLOPs known by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.embed(ids))))


class FeatureMLP(nn.Module):
    """Features in: the tensors autograd saves are known by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, V)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def batch(step: int, rows: int = 4, seq: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, V, (rows, seq), generator=g), torch.randint(0, V, (rows, seq), generator=g)


def loss_of(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float().reshape(-1, V), target.reshape(-1))


def config(tmp_path: Path, **extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "csv_monitor": {"enabled": True, "output_path": str(tmp_path / "runs"), "job_name": "job"},
        **extra,
    }


def train(engine, steps: int, gas: int = 1) -> list[list[float]]:
    """Losses given to backward, per optimizer step."""
    losses = []
    for step in range(steps):
        per_step = []
        for micro in range(gas):
            ids, target = batch(step * gas + micro)
            loss = loss_of(engine(ids), target)
            engine.backward(loss)
            engine.step()
            per_step.append(loss.item())
        losses.append(per_step)
    return losses


def read_csv(path: Path) -> tuple[list[str], list[tuple[int, float]]]:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return rows[0], [(int(r[0]), float(r[1])) for r in rows[1:]]


def test_loss_lr_and_norm_against_torch(tmp_path):
    torch.manual_seed(0)
    model = TokenMLP()
    reference = TokenMLP()
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    cfg = config(tmp_path, gradient_accumulation_steps=2, scheduler={
        "type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 4}})
    engine, *_ = zcore.initialize(model=model, config=cfg, model_parameters=model.parameters())
    records = []
    for step in range(3):
        lr_used = engine.get_lr()[0]
        for micro in range(2):
            ids, target = batch(step * 2 + micro)
            loss = loss_of(engine(ids), target)
            engine.backward(loss)
            engine.step()
            ref_loss = loss_of(reference(ids), target) / 2
            ref_loss.backward()
        norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]).item()
        for g in opt.param_groups:
            g["lr"] = lr_used
        opt.step()
        opt.zero_grad()
        record = engine.last_step_metrics
        records.append(record)
        assert record.global_step == step + 1
        assert record.global_samples == 8 * (step + 1)
        assert record.lr == pytest.approx(lr_used)
        assert record.grad_norm == pytest.approx(norm, rel=1e-5)
        assert record.loss_scale == 1.0 and not record.skipped and record.skipped_steps == 0
    header, rows = read_csv(tmp_path / "runs" / "job" / "Train_Samples_train_loss.csv")
    assert header == ["step", "train_loss"]
    assert rows == [(r.global_samples, pytest.approx(r.loss)) for r in records]
    engine.destroy()


def test_loss_is_the_mean_over_micro_steps(tmp_path):
    torch.manual_seed(0)
    model = TokenMLP()
    engine, *_ = zcore.initialize(
        model=model, config=config(tmp_path, gradient_accumulation_steps=3), model_parameters=model.parameters()
    )
    losses = train(engine, 2, gas=3)
    assert engine.last_step_metrics.loss == pytest.approx(sum(losses[-1]) / 3, rel=1e-6)
    engine.destroy()


def test_time_parts_add_up_and_rates_follow(tmp_path):
    torch.manual_seed(0)
    model = TokenMLP()
    engine, *_ = zcore.initialize(model=model, config=config(tmp_path), model_parameters=model.parameters())
    train(engine, 2)
    with torch.no_grad():  # an evaluation between steps: not the next step's tokens
        engine(torch.randint(0, V, (16, 6)))
    train(engine, 1)
    r = engine.last_step_metrics
    parts = ("forward", "backward", "step", "comm_wait", "nvme_wait", "copy_wait", "other")
    assert all(r.time_ms[p] >= 0 for p in parts)
    assert sum(r.time_ms[p] for p in parts) == pytest.approx(r.time_ms["total"], rel=1e-6)
    assert r.time_ms["forward"] > 0 and r.time_ms["backward"] > 0 and r.time_ms["step"] > 0
    seconds = r.time_ms["total"] / 1e3
    assert r.samples_per_second == pytest.approx(4 / seconds)
    assert r.tokens_per_second == pytest.approx(4 * 6 / seconds)
    # Forward 2*T*(D*H + H*V) in the two Linear layers; backward twice that
    # (input and weight gradients); the embedding and ReLU have no matmul.
    tokens = 4 * 6
    flops = 3 * 2 * tokens * (D * H + H * V)
    assert r.tflops * 1e12 * seconds == pytest.approx(flops, rel=1e-6)
    engine.destroy()


def test_memory_matches_the_memory_report_and_activations_are_counted(tmp_path):
    torch.manual_seed(0)
    model = FeatureMLP()
    for stage in (0, 3):
        cfg = config(tmp_path, zero_optimization={"stage": stage})
        engine, *_ = zcore.initialize(model=model if stage == 0 else FeatureMLP(), config=cfg,
                                      model_parameters=None)
        rows, seq = 4, 6
        for step in range(2):
            x = torch.randn(rows, seq, D)
            out = engine(x)
            engine.backward(out.float().square().mean())
            engine.step()
        r = engine.last_step_metrics
        report = engine.memory_report()
        for tier, figures in report.measured_tiers.items():
            for category in ("parameters", "gradients", "optimizer_states", "buffers"):
                assert r.memory[tier][category] == getattr(figures, category), (stage, tier, category)
        # Saved for backward: the first Linear's input and the ReLU's output
        # (which the second Linear saves too); the weights are not activations.
        assert r.memory["device"]["activations"] == rows * seq * (D + H) * 4, stage
        assert r.memory["host"]["process_rss"] > 0
        engine.destroy()


def test_activations_compose_with_the_users_saved_tensor_hooks(tmp_path):
    torch.manual_seed(0)
    engine, *_ = zcore.initialize(model=FeatureMLP(), config=config(tmp_path, zero_optimization={"stage": 3}))
    packed = []

    def pack(t):
        packed.append(t.shape)
        return t.clone()

    x = torch.randn(4, 6, D)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = engine(x)
    engine.backward(out.square().mean())
    engine.step()
    sizes = [shape.numel() for shape in packed]
    assert 4 * 6 * D in sizes and 4 * 6 * H in sizes  # the user's pack saw the activations
    assert engine.last_step_metrics.memory["device"]["activations"] == 4 * 6 * (D + H) * 4
    engine.destroy()


def test_activations_are_counted_every_step_when_the_users_pack_frees_them(tmp_path):
    """The user's pack keeps a copy (as a compression hook does), so each
    original is freed during the forward and a later activation may take its
    address: counted all the same. Saved: the input (4 x 16 fp32) and each
    Tanh's output (4 x 32), which the next Linear saves too."""
    for stage in (0, 1, 3):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)
        )
        engine, *_ = zcore.initialize(model=model, config=config(tmp_path, zero_optimization={"stage": stage}))
        counted = []
        for step in range(10):
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t * 2, lambda t: t / 2):
                out = engine(torch.randn(4, 16))
            engine.backward(out.square().mean())
            engine.step()
            counted.append(engine.last_step_metrics.memory["device"]["activations"])
        assert counted == [(4 * 16 + 2 * 4 * 32) * 4] * 10, stage
        engine.destroy()


def test_skipped_steps_are_counted(tmp_path):
    torch.manual_seed(0)
    model = TokenMLP()
    cfg = config(tmp_path, fp16={"enabled": True, "initial_scale_power": 4, "hysteresis": 1})
    engine, *_ = zcore.initialize(model=model, config=cfg, model_parameters=model.parameters())
    ids, target = batch(0)
    engine.backward(loss_of(engine(ids), target) * float("inf"))
    engine.step()
    r = engine.last_step_metrics
    assert r.skipped and r.skipped_steps == 1 and not math.isfinite(r.grad_norm)
    assert r.loss_scale == 8.0
    train(engine, 1)
    assert not engine.last_step_metrics.skipped and engine.last_step_metrics.skipped_steps == 1
    header, rows = read_csv(tmp_path / "runs" / "job" / "Train_Samples_skipped_steps.csv")
    assert header == ["step", "skipped_steps"] and [v for _, v in rows] == [1.0, 1.0]
    engine.destroy()


def test_off_measures_nothing(tmp_path):
    model = FeatureMLP()
    cfg = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, *_ = zcore.initialize(model=model, config=cfg, model_parameters=model.parameters())
    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append(torch._C._autograd._top_saved_tensors_default_hooks(False))
            return x

    engine.module.up.register_forward_hook(lambda m, i, o: Probe()(o))
    out = engine(torch.randn(2, D))
    engine.backward(out.square().mean())
    engine.step()
    assert engine.observation.metrics is None and engine.last_step_metrics is None and engine.observation.monitors == []
    assert seen == [None]  # no saved-tensor hooks of zcore's at stages 0-2 without metrics
    assert engine.optimizer.measures_norm is False
    engine.destroy()


def test_csv_monitor_appends_across_runs_in_deepspeeds_format(tmp_path):
    for run in range(2):
        torch.manual_seed(run)
        model = TokenMLP()
        engine, *_ = zcore.initialize(model=model, config=config(tmp_path), model_parameters=model.parameters())
        train(engine, 2)
        engine.destroy()
    job = tmp_path / "runs" / "job"
    header, rows = read_csv(job / "Train_Samples_elapsed_time_ms_forward.csv")
    assert header == ["step", "elapsed_time_ms_forward"]
    assert [s for s, _ in rows] == [4, 8, 4, 8]  # samples; a second run appends
    header, rows = read_csv(job / "Memory_device_optimizer_states.csv")
    assert header == ["step", "optimizer_states"]
    n = sum(p.numel() for p in TokenMLP().parameters())
    assert rows[0][1] == 12 * n  # fp32 master, exp_avg and exp_avg_sq


def test_wall_clock_breakdown_prints_every_steps_per_print(tmp_path, caplog):
    model = TokenMLP()
    cfg = config(tmp_path, wall_clock_breakdown=True, steps_per_print=2, csv_monitor={"enabled": False})
    engine, *_ = zcore.initialize(model=model, config=cfg, model_parameters=model.parameters())
    with caplog.at_level(logging.INFO, logger="zcore.steps"):
        train(engine, 5)
    lines = [r.getMessage() for r in caplog.records if r.name == "zcore.steps" and "time (ms)" in r.getMessage()]
    assert [line.split(":")[0] for line in lines] == ["step 2", "step 4"]
    for part in ("forward", "backward", "step", "waiting on collectives", "NVMe", "copies", "other", "tokens/s"):
        assert part in lines[0]
    assert not list((tmp_path / "runs").glob("**/*.csv"))
    engine.destroy()


def test_tensorboard_writes_the_same_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = TokenMLP()
    cfg = config(tmp_path, csv_monitor={"enabled": False},
                 tensorboard={"enabled": True, "output_path": str(tmp_path / "tb"), "job_name": "job"})
    engine, *_ = zcore.initialize(model=model, config=cfg, model_parameters=model.parameters())
    losses = train(engine, 3)
    engine.destroy()
    events = EventAccumulator(str(tmp_path / "tb" / "job"))
    events.Reload()
    loss = events.Scalars("Train/Samples/train_loss")
    assert [e.step for e in loss] == [4, 8, 12]
    assert [e.value for e in loss] == pytest.approx([step[0] for step in losses], rel=1e-6)
    assert "Train/Samples/elapsed_time_ms_nvme_wait" in events.Tags()["scalars"]
    assert "Memory/device/parameters" in events.Tags()["scalars"]


def test_wandb_writes_its_offline_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    model = TokenMLP()
    cfg = config(tmp_path, csv_monitor={"enabled": False}, wandb={"enabled": True, "project": "zcore-test"})
    engine, *_ = zcore.initialize(model=model, config=cfg, model_parameters=model.parameters())
    train(engine, 2)
    engine.destroy()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    (data,) = runs[0].glob("*.wandb")
    # The history records hold each key as it was logged. wandb-core writes
    # the file from its own process: once, in a full suite run, finish()
    # had returned with only the file's header written, so allow it time.
    keys = [k.encode() for k in ("Train/Samples/train_loss", "Train/Samples/elapsed_time_ms_forward",
                                 "Memory/host/process_rss")]
    deadline = time.monotonic() + 30
    while not all(k in data.read_bytes() for k in keys) and time.monotonic() < deadline:
        time.sleep(0.2)
    content = data.read_bytes()
    for key in keys:
        assert key in content


def test_a_monitor_whose_package_is_missing_is_refused(tmp_path, monkeypatch):
    import importlib

    real = importlib.import_module

    def missing(name, *args):
        if name == "tensorboard":
            raise ImportError(name)
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", missing)
    cfg = config(tmp_path, tensorboard={"enabled": True, "output_path": str(tmp_path)})
    model = TokenMLP()
    with pytest.raises(zcore.ConfigError, match=r"tensorboard.enabled.*pip install tensorboard"):
        zcore.initialize(model=model, config=cfg, model_parameters=model.parameters())


def test_an_unwritable_log_directory_is_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    cfg = config(tmp_path, csv_monitor={"enabled": True, "output_path": str(blocker), "job_name": "job"})
    model = TokenMLP()
    with pytest.raises(zcore.ConfigError, match=r"csv_monitor.*cannot create the log directory.*output_path"):
        zcore.initialize(model=model, config=cfg, model_parameters=model.parameters())


def _two_ranks(rank: int, world: int, nvme: str, runs: str) -> dict:
    torch.manual_seed(0)
    nvme_offload = {"device": "nvme", "nvme_path": nvme}
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "offload_optimizer": nvme_offload, "offload_param": {**nvme_offload, "max_in_cpu": 0}},
        "csv_monitor": {"enabled": True, "output_path": runs, "job_name": "job"},
    }
    model = TokenMLP()
    engine, *_ = zcore.initialize(model=model, config=cfg, model_parameters=model.parameters())
    train(engine, 3)
    r = engine.last_step_metrics
    engine.destroy()
    return {"time": r.time_ms, "memory": r.memory, "tokens": r.tokens_per_second}


def test_two_ranks_with_nvme_offload_wait_on_collectives_and_disk(tmp_path):
    (tmp_path / "nvme").mkdir()
    results = run_ranks(_two_ranks, 2, str(tmp_path / "nvme"), str(tmp_path / "runs"), timeout=240)
    for r in results:
        assert r["time"]["comm_wait"] > 0 and r["time"]["nvme_wait"] > 0
        assert r["memory"]["nvme"]["parameters"] > 0 and r["memory"]["nvme"]["optimizer_states"] > 0
        seconds = r["time"]["total"] / 1e3
        assert r["tokens"] == pytest.approx(2 * 4 * 6 / seconds)  # both ranks' tokens
    # Rank 0 writes; rank 1 has no monitor (its rows would interleave).
    _, rows = read_csv(tmp_path / "runs" / "job" / "Train_Samples_train_loss.csv")
    assert [s for s, _ in rows] == [8, 16, 24]
