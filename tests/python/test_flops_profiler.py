"""The flops profiler (DeepSpeed's "flops_profiler" section): FLOPs of known
models equal the hand count, forward and backward; parameter counts equal
the model's; module_depth, top_modules, detailed and output_file change the
report as DeepSpeed's keys say; only rank 0 prints; nothing stays installed
outside the profiled step; and under ZeRO stage 3 (world 1 and 2, every
parameter a placeholder between uses) each module's forward FLOPs and
parameters, and the backward's FLOPs, are those of the plain eager model,
activation checkpointing included."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import set_checkpoint_early_stop as checkpoint_early_stop

import zcore
from distributed import run_ranks
from models import TinyGPT
from training import ON_DEMAND, zcore_config
from zcore.config.schema import FlopsProfilerConfig
from zcore.errors import ConfigError, InvalidStateError
from zcore.observe.flops_profiler import FlopsProfiler, ProfilerState

BATCH = 4
# TinyGPT: vocabulary, sequence, width, heads, blocks.
V, T, D, H, L = 64, 16, 32, 2, 2


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def profile_eager(model: nn.Module, inputs: list[torch.Tensor], **config) -> tuple:
    """One profiled step of plain torch over ``inputs`` (one micro-batch
    each); returns the report and what was printed."""
    profiler = FlopsProfiler(model, FlopsProfilerConfig(enabled=True, **config), rank=0, world_size=1)
    profiler.start()
    for x in inputs:
        model(x).float().pow(2).mean().backward()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        report = profiler.stop(step_seconds=0.002)
    return report, printed.getvalue()


def hooks_of(model: nn.Module) -> list[int]:
    return [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()]


def test_mlp_flops_and_params_equal_the_hand_count():
    model = mlp()
    before = hooks_of(model)
    report, _ = profile_eager(model, [torch.randn(BATCH, 16), torch.randn(BATCH, 16)])
    assert hooks_of(model) == before
    assert not torch.nn.modules.module._global_forward_pre_hooks  # the counter's module tracker is gone
    first, second = 2 * 16 * 32 * BATCH * 2, 2 * 32 * 8 * BATCH * 2  # 2 in out batch, two forwards
    assert report.forwards == 2
    assert [(m.name, m.params, m.fwd_flops) for m in report.modules] == [
        ("", 16 * 32 + 32 + 32 * 8 + 8, first + second),
        ("0", 16 * 32 + 32, first),
        ("1", 0, 0),
        ("2", 32 * 8 + 8, second),
    ]
    # Backward: the first layer's input needs no gradient (its weight's does),
    # the second computes both.
    assert report.bwd_flops == first + 2 * second and report.flops == 2 * first + 3 * second
    assert report.model.fwd_latency > 0 and report.bwd_latency > 0 and report.step_latency == 0.002


def gpt_forward_flops(batch: int) -> dict[str, int]:
    rows = batch * T
    linears = {"c_attn": D * 3 * D, "c_proj": D * D, "c_fc": D * 4 * D, "c_out": 4 * D * D}
    attention = 2 * (2 * batch * H * T * T * (D // H))  # scores and weighted sum, causal mask ignored
    block = sum(2 * rows * n for n in linears.values()) + attention
    out = {f"blocks.0.{name}": 2 * rows * n for name, n in linears.items()}
    out.update({"blocks.0": block, "lm_head": 2 * rows * D * V, "": L * block + 2 * rows * D * V})
    return out


def test_gpt_forward_flops_equal_the_hand_count():
    torch.manual_seed(0)
    model = TinyGPT()
    report, _ = profile_eager(model, [torch.randint(0, V, (BATCH, T))])
    for name, flops in gpt_forward_flops(BATCH).items():
        assert report.module(name).fwd_flops == flops, name
    assert [(m.name, m.params) for m in report.modules] == [
        (name, sum(p.numel() for p in module.parameters())) for name, module in model.named_modules()
    ]
    assert report.model.params == sum(p.numel() for p in model.parameters())  # the tied head counted once


def depth_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("depth ")]


def test_module_depth_top_modules_and_detailed_shape_the_report():
    torch.manual_seed(0)
    model, x = TinyGPT(), [torch.randint(0, V, (BATCH, T))]
    _, everything = profile_eager(model, x, module_depth=-1, top_modules=3)
    assert depth_lines(everything) == ["depth 0:", "depth 1:", "depth 2:", "depth 3:"]
    assert "params      - {'ModuleList': '25.22 K', 'Embedding': '2.56 K', 'Linear': '2.05 K'}" in everything
    assert "Detailed profile" in everything and "      (c_attn) Linear: 3.07 K = 11.03% params" in everything
    assert "step latency:" in everything

    _, shallow = profile_eager(model, x, module_depth=1, top_modules=1, detailed=False)
    assert depth_lines(shallow) == ["depth 0:", "depth 1:"]
    assert "params      - {'ModuleList': '25.22 K'}" in shallow
    assert "Detailed profile" not in shallow and "(c_attn)" not in shallow


def test_output_file_is_written_by_rank_0_only(tmp_path, capsys):
    model, x = mlp(), torch.randn(BATCH, 16)
    for rank in (1, 0):
        path = tmp_path / f"rank{rank}" / "profile.txt"
        profiler = FlopsProfiler(model, FlopsProfilerConfig(enabled=True, output_file=str(path)), rank, 2)
        profiler.start()
        model(x).sum().backward()
        profiler.stop()
        assert path.exists() == (rank == 0)
    assert "zcore flops profiler" in (tmp_path / "rank0" / "profile.txt").read_text()
    assert capsys.readouterr().out == ""  # the file instead of stdout


def test_other_ranks_print_nothing(capsys):
    model = mlp()
    profiler = FlopsProfiler(model, FlopsProfilerConfig(enabled=True), rank=1, world_size=2)
    profiler.start()
    model(torch.randn(BATCH, 16)).sum().backward()
    assert profiler.stop().model.fwd_flops > 0
    assert capsys.readouterr().out == ""


def test_profile_step_counts_completed_optimizer_steps_and_profiles_once():
    profiler = FlopsProfiler(mlp(), FlopsProfilerConfig(enabled=True, profile_step=2), rank=0, world_size=1)
    assert [profiler.profiles(step) for step in range(4)] == [False, False, True, False]
    assert profiler.state is ProfilerState.WAITING
    with pytest.raises(InvalidStateError, match="stop.*while waiting"):
        profiler.stop()
    profiler.start()
    with pytest.raises(InvalidStateError, match="start.*while profiling"):
        profiler.start()
    profiler.close()  # the run ended inside the profiled step: nothing reported, nothing left
    assert profiler.state is ProfilerState.DONE
    with pytest.raises(InvalidStateError, match="start.*while done"):
        profiler.start()


def test_configurations_it_cannot_honour_are_refused(tmp_path):
    model = mlp()
    with pytest.raises(ConfigError, match="recompute_fwd_factor=1.0: zcore counts the backward's FLOPs"):
        FlopsProfiler(model, FlopsProfilerConfig(enabled=True, recompute_fwd_factor=1.0), 0, 1)
    with pytest.raises(ConfigError, match="output_file=.*: it is a directory"):
        FlopsProfiler(model, FlopsProfilerConfig(enabled=True, output_file=str(tmp_path)), 0, 1)
    (tmp_path / "file").write_text("")
    under_a_file = str(tmp_path / "file" / "profile.txt")
    with pytest.raises(ConfigError, match="is not a directory"):
        FlopsProfiler(model, FlopsProfilerConfig(enabled=True, output_file=under_a_file), 0, 1)
    FlopsProfiler(model, FlopsProfilerConfig(enabled=True, output_file=under_a_file), 1, 2)  # rank 0 writes


def comparable(report) -> list[tuple]:
    return [(m.name, m.params, m.fwd_flops) for m in report.modules] + [("backward", report.bwd_flops)]


def profile_stage3(rank: int, world: int, gas: int, checkpoint_blocks: bool) -> dict:
    """Step 0 plain, step 1 profiled, as the engine will drive it; and the
    eager model on the same micro-batch shape."""
    torch.manual_seed(0)
    eager, _ = profile_eager(
        TinyGPT(checkpoint_blocks=checkpoint_blocks), [torch.randint(0, V, (BATCH, T)) for _ in range(gas)]
    )
    config = zcore_config(3, gas, 0.0, zero=ON_DEMAND, train_batch_size=BATCH * world * gas)
    engine, *_ = zcore.initialize(model=TinyGPT(checkpoint_blocks=checkpoint_blocks), config=config)
    placeholders = [p.data.numel() < p.numel() for p in engine.module.parameters()]
    profiler = FlopsProfiler(engine.module, FlopsProfilerConfig(enabled=True), rank, world)
    printed = io.StringIO()
    for _ in range(2 * gas):
        if profiler.state is ProfilerState.WAITING and profiler.profiles(engine.global_steps):
            profiler.start()
        engine.backward(engine(torch.randint(0, V, (BATCH, T))).float().pow(2).mean())
        engine.step()
        if profiler.state is ProfilerState.PROFILING and engine.accumulated_micro_steps == 0:
            with contextlib.redirect_stdout(printed):
                report = profiler.stop()
    engine.destroy()
    return {
        "eager": comparable(eager),
        "zcore": comparable(report),
        "forwards": report.forwards,
        "printed": printed.getvalue(),
        "placeholders": any(placeholders),
    }


def profile_variants(rank: int, world: int, gas: int, variants: tuple[bool, ...]) -> dict:
    # zcore's forward turns off the early stop of recomputation (torch's
    # default, which skips a block's last matmul), so the eager model does too.
    with checkpoint_early_stop(False):
        return {checkpointed: profile_stage3(rank, world, gas, checkpointed) for checkpointed in variants}


def row(rows: list[tuple], name: str) -> tuple:
    return next(r for r in rows if r[0] == name)


def test_stage3_world_1_profiles_as_the_eager_model():
    (got,) = run_ranks(profile_variants, 1, 2, (False, True), launcher=False, timeout=120)
    for variant in got.values():
        assert variant["placeholders"]  # parameters are counted whole though they hold no values
        assert variant["zcore"] == variant["eager"] and variant["forwards"] == 2
        assert "zcore flops profiler" in variant["printed"]
    plain, checkpointed = got[False]["zcore"], got[True]["zcore"]
    block = gpt_forward_flops(BATCH)["blocks.0"]
    assert row(plain, "blocks.0")[2] == row(checkpointed, "blocks.0")[2] == 2 * block  # two micro-batches
    # Backward recomputes each checkpointed block's forward: counted, no factor needed.
    assert row(checkpointed, "backward")[1] == row(plain, "backward")[1] + 2 * L * block


def test_stage3_two_ranks_profile_as_the_eager_model_and_only_rank_0_prints():
    results = run_ranks(profile_variants, 2, 1, (False,), timeout=120)
    for got in results:
        got = got[False]
        assert got["placeholders"] and got["zcore"] == got["eager"] and got["forwards"] == 1
    assert "zcore flops profiler" in results[0][False]["printed"] and results[1][False]["printed"] == ""


def test_the_engine_profiles_the_configured_step_from_its_config(tmp_path):
    """The config section alone: the step counted as DeepSpeed counts it,
    every micro-batch of it, the report written to output_file, nothing
    installed before or after."""
    model = mlp()
    out = tmp_path / "flops.txt"
    cfg = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "flops_profiler": {"enabled": True, "profile_step": 2, "output_file": str(out)},
    }
    engine, *_ = zcore.initialize(model=model, config=cfg, model_parameters=model.parameters())
    before = hooks_of(engine.module)
    for step in range(4):
        for _ in range(2):
            engine.backward(engine(torch.randn(BATCH, 16)).float().pow(2).mean())
            engine.step()
        if step < 2:
            assert engine.flops_report is None and not out.exists()
        assert hooks_of(engine.module) == before
    report = engine.flops_report
    assert report.step == 2 and report.forwards == 2
    first, second = 2 * 16 * 32 * BATCH * 2, 2 * 32 * 8 * BATCH * 2
    assert report.model.fwd_flops == first + second
    assert report.bwd_flops == first + 2 * second
    assert report.step_latency is not None and report.step_latency > 0
    assert out.read_text().strip() == report.text.strip()
    engine.destroy()
