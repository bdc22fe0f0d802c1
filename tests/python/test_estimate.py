"""zcore.estimate_memory against what engines hold (engine.memory_report(),
per tier and category, and stage 3's gather arena), on the CI models, over
the stages and offload settings; the recommendation against budgets worked
out by hand; the zcore estimate command; and bad inputs."""

from __future__ import annotations

import argparse
import json
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zcore
from distributed import run_ranks
from models import TinyGPT, make_model
from training import ON_DEMAND, train_zcore, zcore_config
from zcore.cli import main, parameter_count

TOLERANCE = 0.10  # the bound, per tier; the layouts are counted exactly, so it is met with room


def lean(config: dict, bf16_states: bool) -> dict:
    config["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=bf16_states)
    return config


def cases(nvme: str) -> dict[str, tuple[str, dict]]:
    """label -> (model in models.MODELS, config)."""
    on_nvme = {"device": "nvme", "nvme_path": nvme}
    # Groups of fewer than 1000 elements (the tiny GPT's norms) stay gathered, the others do not.
    some_persistent = {"stage3_param_persistence_threshold": 1000}
    return {
        "gpt stage 0": ("gpt", zcore_config(0, 1, 0.0)),
        "norm stage 0 (buffers, frozen)": ("norm", zcore_config(0, 1, 0.0)),
        "gpt stage 1": ("gpt", zcore_config(1, 2, 0.0)),
        "mix stage 1 bf16": ("mix", zcore_config(1, 1, 0.0, "bf16")),
        "gpt stage 2 bf16": ("gpt", zcore_config(2, 1, 0.0, "bf16")),
        "norm stage 2, optimizer on cpu": ("norm", zcore_config(2, 1, 0.0, offload=True)),
        "gpt stage 2, optimizer on nvme": ("gpt", zcore_config(2, 1, 0.0, zero={"offload_optimizer": on_nvme})),
        "gpt stage 3, some persistent, bf16": ("gpt", zcore_config(3, 1, 0.0, "bf16", zero=some_persistent)),
        "mix stage 3, optimizer on cpu": ("mix", zcore_config(3, 1, 0.0, offload=True, zero=ON_DEMAND)),
        "gpt stage 3, parameters on cpu": (
            "gpt", zcore_config(3, 1, 0.0, zero={**ON_DEMAND, "offload_param": {"device": "cpu"}})),
        "gpt stage 3, optimizer on nvme": ("gpt", zcore_config(3, 1, 0.0, zero={**ON_DEMAND, "offload_optimizer": on_nvme})),
        "gpt stage 3, parameters on nvme": (
            "gpt", zcore_config(3, 1, 0.0, zero={**ON_DEMAND, "offload_param": {**on_nvme, "max_in_cpu": 0}})),
        # bf16 master weights (and moments): 2 bytes each where fp32 takes 4.
        "gpt stage 2, bf16 master and moments": ("gpt", lean(zcore_config(2, 1, 0.0, "bf16"), True)),
        "gpt stage 1, bf16 master, fp32 moments on cpu": (
            "gpt", lean(zcore_config(1, 1, 0.0, "bf16", offload=True), False)),
        "gpt stage 3, bf16 master and moments on nvme": (
            "gpt", lean(zcore_config(3, 1, 0.0, "bf16", zero={**ON_DEMAND, "offload_optimizer": on_nvme}), True)),
        # max_in_cpu keeps the first groups' shards in host memory, the rest go to NVMe.
        "norm stage 3, both on nvme, split": (
            "norm", zcore_config(3, 1, 0.0, zero={**ON_DEMAND, "offload_optimizer": on_nvme,
                                                 "offload_param": {**on_nvme, "max_in_cpu": 600}})),
    }


WORLD_2 = ("gpt stage 1", "mix stage 3, optimizer on cpu", "gpt stage 3, parameters on nvme")


def measure(rank: int, world: int, labels: list[str], nvme: str) -> dict:
    """Each case trained for two steps: its memory report and gather statistics."""
    out = {}
    for label in labels:
        name, config = cases(nvme)[label]
        run = train_zcore(rank, world, name, config, steps=2)
        out[label] = (run["memory"], run["gather_stats"])
    return out


@pytest.fixture(scope="module")
def nvme_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("nvme"))


@pytest.fixture(scope="module")
def measured_world_1(nvme_dir) -> dict:
    (by_label,) = run_ranks(measure, 1, list(cases(nvme_dir)), nvme_dir, launcher=False, timeout=300)
    return by_label


def assert_close(estimate, report, where: str) -> None:
    for tier in ("device", "host", "nvme"):
        predicted = estimate.tiers[tier].model_states
        measured = report.measured_tiers[tier]
        for category in ("parameters", "gradients", "optimizer_states", "buffers"):
            p, m = getattr(predicted, category), getattr(measured, category)
            assert abs(p - m) <= TOLERANCE * m, f"{where}: {category} on {tier}: estimated {p}, measured {m}"
        assert abs(predicted.total - measured.total) <= TOLERANCE * measured.total, where


@pytest.mark.parametrize("label", list(cases("")))
def test_estimate_matches_memory_report(label, measured_world_1, nvme_dir):
    name, config = cases(nvme_dir)[label]
    report, gather = measured_world_1[label]
    estimate = zcore.estimate_memory(make_model(name), config, 1, device="cpu")
    assert_close(estimate, report, label)
    assert (estimate.stage, estimate.parameter_tier, estimate.optimizer_tier) == (
        report.stage, report.parameter_tier, report.optimizer_tier)
    if report.stage == 3:
        assert estimate.tiers["device"].gather_buffers == gather.arena_capacity, label


def test_estimate_matches_memory_report_at_world_2(nvme_dir):
    by_rank = run_ranks(measure, 2, list(WORLD_2), nvme_dir, timeout=300)
    for label in WORLD_2:
        name, config = cases(nvme_dir)[label]
        estimate = zcore.estimate_memory(make_model(name), config, 2, device="cpu")
        for rank, measured in enumerate(by_rank):
            report, gather = measured[label]
            assert report.world_size == 2
            assert_close(estimate, report, f"{label}, rank {rank}")
            if report.stage == 3:
                assert estimate.tiers["device"].gather_buffers == gather.arena_capacity


def layers() -> nn.Module:
    return nn.Sequential(*(nn.Linear(500, 500) for _ in range(4)))  # 4 x 250,500 parameters


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_bare_count_gives_the_model_states_of_the_module(stage):
    config = {"bf16": {"enabled": True}, "zero_optimization": {"stage": stage, **ON_DEMAND}}
    module = zcore.estimate_memory(layers(), config, 4)
    count = zcore.estimate_memory(4 * 250_500, config, 4)
    for tier in ("device", "host", "nvme"):
        a, b = module.tiers[tier].model_states, count.tiers[tier].model_states
        assert abs(a.total - b.total) <= 0.01 * a.total, (tier, a, b)
    assert count.trainable_parameters == module.trainable_parameters == 1_002_000
    assert any("bare count" in a for a in count.assumptions)
    assert not any("bare count" in a for a in module.assumptions)


def test_a_meta_model_is_counted_without_allocating():
    with torch.device("meta"):
        meta = TinyGPT()
    config = zcore_config(3, 1, 0.0, "bf16", zero={"offload_param": {"device": "cpu"}})
    ids = torch.zeros(2, 16, dtype=torch.long)
    on_meta = zcore.estimate_memory(meta, config, 2, sample_input=ids)
    on_cpu = zcore.estimate_memory(TinyGPT(), config, 2, sample_input=ids)
    assert on_meta.tiers == on_cpu.tiers
    assert all(p.is_meta for p in meta.parameters())


def test_activations_are_measured_given_or_unknown():
    config = zcore_config(2, 1, 0.0)
    model = TinyGPT()
    one = zcore.estimate_memory(model, config, 1, sample_input=torch.zeros(2, 16, dtype=torch.long))
    two = zcore.estimate_memory(model, config, 1, sample_input=(torch.zeros(4, 16, dtype=torch.long),))
    assert one.activations_known and one.tiers["device"].activations > 0
    # Saved tensors grow with the batch (the positions' embedding does not).
    assert 1.8 * one.tiers["device"].activations < two.tiers["device"].activations <= 2 * one.tiers["device"].activations
    bf16 = zcore.estimate_memory(model, zcore_config(2, 1, 0.0, "bf16"), 1, sample_input=torch.zeros(2, 16, dtype=torch.long))
    assert bf16.tiers["device"].activations < 0.7 * one.tiers["device"].activations
    assert model.training is True  # put back as it was
    given = zcore.estimate_memory(10**6, config, 1, activations=3 << 20)
    assert given.tiers["device"].activations == 3 << 20
    unknown = zcore.estimate_memory(10**6, config, 1)
    assert not unknown.activations_known
    assert "unknown" in str(unknown) and "MiB" in str(unknown)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, 96)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, 2, 16).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_attention_counts_what_fused_kernels_save():
    """The meta device runs attention unfused; a GPU's flash kernel saves
    query, key and value (views of the projection's output), the output and
    an fp32 log-sum-exp per row, never the (seq x seq) scores."""
    batch, seq, heads = 2, 64, 2
    x = torch.zeros(batch, seq, 32)
    estimate = zcore.estimate_memory(Attention(), {}, 1, sample_input=x)
    by_hand = 4 * (x.numel() + batch * seq * 96 + batch * seq * 32 + batch * heads * seq)  # x, qkv, output, lse
    assert estimate.tiers["device"].activations == by_hand == 82_944


# A bare count of 100M parameters in bf16 at world size 4 on GPUs, worked out by hand
# (Psi = 1e8 elements; units of 4,194,304 elements, a multiple of 4: no padding).
PSI = 100_000_000
UNIT = 1 << 22
STAGE2_DEVICE = 2 * PSI + 4 * PSI // 4 + 12 * PSI // 4 + 3 * (UNIT + UNIT // 4) * 4  # params, grads, states, buckets
STAGE3_DEVICE = 2 * PSI // 4 + 4 * PSI // 4 + 12 * PSI // 4 + 2 * PSI  # shard, grads, states, arena (whole model)
BF16 = {"bf16": {"enabled": True}}
SHORT = 640_000_000  # device bytes: less than stages 2 and 3 need


def test_recommendation_takes_the_first_choice_that_fits(tmp_path):
    for stage, device in ((2, STAGE2_DEVICE), (3, STAGE3_DEVICE)):
        assert zcore.estimate_memory(PSI, {**BF16, "zero_optimization": {"stage": stage}}, 4).total("device") == device
    fits = zcore.recommend_config(PSI, BF16, 4, device_memory=STAGE2_DEVICE, host_memory=1 << 30, activations=0)
    assert fits.zero_optimization == {"stage": 2}
    assert [r.split(" ")[:3] for r in fits.reasons[:2]] == [["stage", "0", "does"], ["stage", "1", "does"]]

    # Stages 2 and 3 miss; with the optimizer on the host the device keeps parameters,
    # gradient shards and buckets, the host the states and fp32 gradient copies.
    squeezed = zcore.recommend_config(PSI, BF16, 4, device_memory=SHORT, host_memory=1 << 30, activations=0)
    assert squeezed.zero_optimization == {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    assert squeezed.estimate.total("host") == 12 * PSI // 4 + 4 * PSI // 4
    assert "stage 3 does not fit: device 619.9 MiB > 610.4 MiB budget per device" in squeezed.reasons
    assert squeezed.reasons[-1].startswith("stage 2, optimizer states on host fits: device")

    # Host memory short too (the cpu choices need 400 MB per rank and more): without an
    # NVMe path nothing fits; with one, the states go to NVMe and parameters to the host.
    with pytest.raises(zcore.InvalidArgumentError, match="(?s)no configuration fits.*nvme_path.*at world size 8, stage 2 fits"):
        zcore.recommend_config(PSI, BF16, 4, device_memory=SHORT, host_memory=350_000_000, activations=0)
    nvme = zcore.recommend_config(PSI, BF16, 4, device_memory=SHORT, host_memory=350_000_000,
                                  nvme_path=str(tmp_path), activations=0)
    assert nvme.zero_optimization == {
        "stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}, "offload_param": {"device": "cpu"},
    }
    assert nvme.estimate.total("nvme") >= 4 * PSI // 4 + 12 * PSI // 4  # gradients and states
    # Four ranks to a node share its host memory.
    with pytest.raises(zcore.InvalidArgumentError, match="per node of 4 ranks"):
        zcore.recommend_config(PSI, BF16, 4, device_memory=SHORT, host_memory=350_000_000,
                               nvme_path=str(tmp_path), nvme_memory=1 << 40, ranks_per_node=4, activations=0)


def test_bad_inputs_name_the_fix():
    for world in (0, -2, 1.5, True):
        with pytest.raises(zcore.InvalidArgumentError, match="world_size must be a positive integer"):
            zcore.estimate_memory(10**6, {}, world)
    with pytest.raises(zcore.ConfigError, match="offload_optimizer.device"):
        zcore.estimate_memory(10**6, {"zero_optimization": {"offload_optimizer": {"device": "gpu"}}}, 1)
    ignored = zcore.estimate_memory(10**6, {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, 1)
    assert ignored == zcore.estimate_memory(10**6, {"zero_optimization": {"stage": 2}}, 1)  # as DeepSpeed ignores it
    for model in (0, -5, "gpt2", None):
        with pytest.raises(zcore.InvalidArgumentError, match="torch.nn.Module or a positive number"):
            zcore.estimate_memory(model, {}, 1)
    with pytest.raises(zcore.InvalidArgumentError, match="device_memory must be a positive integer"):
        zcore.recommend_config(10**6, {}, 1, device_memory=-1, host_memory=1 << 30)
    for sample in (torch.zeros(1, 4), torch.zeros(4, dtype=torch.long), (torch.zeros(1, 4, dtype=torch.long),)):
        with pytest.raises(zcore.InvalidArgumentError, match="with a bare parameter count, sample_input must be token"):
            zcore.estimate_memory(10**6, {}, 1, sample_input=sample)
    with pytest.raises(zcore.InvalidArgumentError, match="raise the budgets"):
        zcore.recommend_config(10**9, {}, 1, device_memory=1 << 20, host_memory=1 << 20, activations=0)
    assert [parameter_count(t) for t in ("1.3B", "350M", "125k", "7e9", "42")] == [
        1_300_000_000, 350_000_000, 125_000, 7_000_000_000, 42]
    for text in ("abc", "0", "1.3X"):
        with pytest.raises(argparse.ArgumentTypeError, match="parameter count"):
            parameter_count(text)


def test_the_command_prints_each_choice_and_the_recommendation(tmp_path, capsys):
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 2}))
    code = main(["estimate", "--params", "1.3B", "--config", str(config), "--world-size", "8", "--activations", "2GiB",
                 "--device-memory", "16GiB", "--host-memory", "64GiB", "--ranks-per-node", "8"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.count("zcore estimate per rank") == 7  # the NVMe choices need a path
    assert "not estimated: no nvme_path" in out
    assert "recommended: stage 1" in out and '"stage": 1' in out


def test_the_command_builds_models_on_meta(tmp_path, capsys):
    from transformers import GPT2Config

    GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=64).save_pretrained(tmp_path)
    assert main(["estimate", "--model", f"hf:{tmp_path}", "--seq-len", "32", "--world-size", "2",
                 "--nvme-path", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("zcore estimate per rank") == 9 and "unknown" not in out
    assert main(["estimate", "--model", "models:TinyGPT", "--device", "cpu"]) == 0
    assert re.search(r"activations +unknown", capsys.readouterr().out)
    assert main(["estimate", "--model", "models:nothing_here"]) == 1
    assert "nothing_here" in capsys.readouterr().err
    assert main(["estimate", "--params", "1B", "--device-memory", "8GiB"]) == 2
    with pytest.raises(SystemExit):
        main(["estimate", "--params", "lots"])


def test_tensor_and_pipeline_ranks_split_a_count_evenly(capsys):
    """--tp and --pp: each rank holds 1/(tp x pp) of --params, sharded over
    the --world-size data-parallel ranks; the figures are those of that share."""
    assert main(["estimate", "--params", "1B", "--world-size", "2", "--tp", "2", "--pp", "4"]) == 0
    split = capsys.readouterr().out
    assert "1000000000 parameters split evenly over 2 tensor-parallel x 4 pipeline ranks: 125000000 per rank" in split
    assert main(["estimate", "--params", "125M", "--world-size", "2"]) == 0
    share = capsys.readouterr().out
    assert split.split("\n\n", 1)[1] == share
    assert main(["estimate", "--model", "models:TinyGPT", "--tp", "2"]) == 2
    assert "zcore.estimate_memory(module, config, data_parallel_size)" in capsys.readouterr().err
    # --seq-len runs a shape assumed for the whole count, not one rank's part.
    assert main(["estimate", "--params", "1B", "--tp", "2", "--seq-len", "128"]) == 2
    assert "give one rank's activations with --activations" in capsys.readouterr().err
