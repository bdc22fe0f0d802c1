"""A recommendation never calls a choice "fits" while the activations are
left out (issue 40, item 2).

Regression: `zcore estimate --params 1.3B --device-memory 24GiB` (with
planning.md's config: bf16, AdamW, micro-batch 4, 8 ranks) recommended
stage 0, "device 21.8 GiB of 24.0 GiB", with activations unknown, while
the same shape from its model config at --seq-len 1024 saves 12.4 GiB of
activations and stage 0 then needs 34.5 GiB: stage 1 is the answer. Now,
without a sequence length nothing is recommended and the error says what
to pass; with one, a bare count's activations are those of a GPT-like
shape assumed from it (printed), and stage 1 is recommended.
"""

from __future__ import annotations

import json

import pytest
import torch

import zcore
from zcore.cli import main
from zcore.plan.assumed_gpt import GPTShape

CONFIG = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
          "optimizer": {"type": "AdamW", "params": {"lr": 0.0001}}}  # docs/guide/planning.md's
GIB = 2**30
BUDGETS = dict(device_memory=24 * GIB, host_memory=256 * GIB, ranks_per_node=8)
COUNT = 1_300_000_000
TOKENS = torch.zeros(4, 1024, dtype=torch.long)  # the config's micro-batch x --seq-len 1024
SHAPE = "GPT-2's layout with 24 layers, width 2048, 32 heads"


def test_the_assumed_shape_of_1_3b_is_gpt3_xl():
    """GPT-3's depth for its nearest size (1.3B: 24 layers), and the width
    (a multiple of 128) whose count is nearest."""
    shape = GPTShape.of(COUNT, positions=1024)
    assert (shape.layers, shape.width, shape.heads) == (24, 2048, 32)
    assert shape.parameters == 1_313_626_112  # transformers' GPT2Config(n_layer=24, n_embd=2048)'s
    assert (GPTShape.of(125_000_000, 2048).layers, GPTShape.of(125_000_000, 2048).width) == (12, 768)
    assert (GPTShape.of(175_000_000_000, 2048).layers, GPTShape.of(175_000_000_000, 2048).width) == (96, 12288)


def test_recommend_config_without_activations_recommends_nothing_and_says_what_to_pass():
    with pytest.raises(zcore.InvalidArgumentError) as refused:
        zcore.recommend_config(COUNT, CONFIG, 8, **BUDGETS)
    message = str(refused.value)
    assert "activations unknown" in message and "nothing is recommended" in message
    assert "the cheapest choice that fits without them, stage 0, leaves 2.2 GiB of the 24.0 GiB device" in message
    assert "sample_input=torch.zeros(B, N, dtype=torch.long)" in message and "activations=<bytes>" in message
    assert "GPT-like shape assumed from it" in message
    assert refused.value.argument == "activations"


def test_recommend_config_with_a_sequence_length_recommends_stage_1():
    chosen = zcore.recommend_config(COUNT, CONFIG, 8, sample_input=TOKENS, **BUDGETS)
    assert chosen.zero_optimization == {"stage": 1}
    assert chosen.reasons[0].startswith("stage 0 does not fit: device 33.5 GiB > 24.0 GiB")
    assert chosen.reasons[1].startswith("stage 1 fits: device 22.0 GiB of 24.0 GiB")
    assert any(SHAPE in note for note in chosen.estimate.assumptions)
    assert 11 * GIB < chosen.estimate.tiers["device"].activations < 12 * GIB


def test_the_command_without_a_sequence_length_prints_the_figures_and_refuses(tmp_path, capsys):
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps(CONFIG))
    command = ["estimate", "--params", "1.3B", "--config", str(config), "--world-size", "8", "--ranks-per-node", "8",
               "--device-memory", "24GiB", "--host-memory", "256GiB"]
    assert main(command) == 1
    out, err = capsys.readouterr()
    assert out.count("zcore estimate per rank") == 7 and "recommended" not in out
    assert "stage 0, leaves 2.2 GiB of the 24.0 GiB device" in err
    assert "zcore estimate --seq-len N" in err and "--activations 6GiB" in err

    assert main([*command, "--seq-len", "1024"]) == 0
    out = capsys.readouterr().out
    assert "recommended: stage 1\n- stage 0 does not fit: device 33.5 GiB > 24.0 GiB budget per device\n" in out
    assert '"stage": 1' in out
    assert SHAPE in out  # the assumption, printed


def test_the_assumed_shape_saves_what_transformers_gpt2_of_that_shape_saves():
    """The model given instead of its count: transformers' GPT-2 of the
    same shape saves 6% more (the key and value copies of its cache), and
    the recommendation is the same; without a sample input, the refusal
    names the model config's longest sequence."""
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=24, n_embd=2048, n_head=16))
    chosen = zcore.recommend_config(gpt2, CONFIG, 8, sample_input=TOKENS, **BUDGETS)
    assumed = zcore.estimate_memory(COUNT, CONFIG, 8, sample_input=TOKENS)
    measured = chosen.estimate.tiers["device"].activations
    assert 12.4 * GIB < measured < 12.5 * GIB  # the figure
    assert 0.93 * measured < assumed.tiers["device"].activations < measured
    assert chosen.zero_optimization == {"stage": 1}
    assert chosen.reasons[0].startswith("stage 0 does not fit: device 34.5 GiB > 24.0 GiB")
    with pytest.raises(zcore.InvalidArgumentError, match="the model's config allows up to 1024 positions"):
        zcore.recommend_config(gpt2, CONFIG, 8, **BUDGETS)
