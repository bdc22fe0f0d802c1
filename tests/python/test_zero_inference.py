"""ZeRO-Inference: ``zcore.initialize`` without an optimizer gives an engine
for forward passes and generation, its parameters sharded and on the device,
the host or NVMe. Greedy generation gives the same tokens, and forward the
same logits, as the plain model in one process; a training checkpoint loads
into it (weights only); training calls are refused by name."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import zcore
from distributed import run_ranks
from models import global_batch, make_model
from training import GLOBAL_BATCH, train_zcore, zcore_config

PROMPT = torch.tensor([[1, 7, 3, 9], [4, 4, 2, 60]])
NEW_TOKENS = 10


def greedy(model, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """Appends the most likely token ``steps`` times, re-reading the whole
    (at most seq_len tokens) context each time."""
    tokens = prompt
    with torch.no_grad():
        for _ in range(steps):
            logits = model(tokens[:, -16:])
            tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens


def inference_config(offload: str, path: str, precision: str = "fp32") -> dict:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if offload != "none":
        # max_in_cpu 0: every shard on NVMe (by default the first 1e9 elements stay on the host).
        zero["offload_param"] = {"device": offload, **({"nvme_path": path, "max_in_cpu": 0} if offload == "nvme" else {})}
    config = {"zero_optimization": zero}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def generate(rank: int, world: int, offload: str, path: str, precision: str, load_dir: str | None) -> dict:
    engine, optimizer, _, scheduler = zcore.initialize(
        model=make_model("gpt"), config=inference_config(offload, path, precision)
    )
    if load_dir is not None:
        engine.load_checkpoint(load_dir)
    tokens = greedy(engine, PROMPT, NEW_TOKENS)
    with torch.no_grad():
        logits = engine(PROMPT).float()
    refused = []
    for call in (lambda: engine.backward(logits.sum()), engine.step, lambda: engine.save_checkpoint(path)):
        try:
            call()
        except zcore.InvalidStateError as exc:
            refused.append(str(exc))
    stats = engine.gather_stats()
    engine.destroy()
    return {"tokens": tokens, "logits": logits, "optimizer": optimizer, "scheduler": scheduler,
            "refused": refused, "fetches": stats.shard_fetches}


def reference(precision: str, model=None) -> tuple[torch.Tensor, torch.Tensor]:
    model = model if model is not None else make_model("gpt")
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    with torch.no_grad():
        return greedy(model, PROMPT, NEW_TOKENS), model(PROMPT).float()


@pytest.mark.parametrize(("world", "offload", "precision"), [
    (1, "nvme", "fp32"), (2, "nvme", "fp32"), (2, "cpu", "bf16"), (3, "none", "fp32"), (1, "nvme", "bf16"),
])
def test_generates_as_the_plain_model(world: int, offload: str, precision: str, tmp_path: Path) -> None:
    got = run_ranks(generate, world, offload, str(tmp_path), precision, None, launcher=world > 1)
    tokens, logits = reference(precision)
    for rank in got:
        assert torch.equal(rank["tokens"], tokens)
        assert torch.allclose(rank["logits"], logits, rtol=1e-5, atol=1e-5)
        assert rank["optimizer"] is None and rank["scheduler"] is None
        assert len(rank["refused"]) == 3 and all("no optimizer" in m for m in rank["refused"])
        assert rank["fetches"] > 0 or offload == "none"
    assert os.listdir(tmp_path) == []  # every rank's destroy() removed its swap files


def trained_then_saved(rank: int, world: int, path: str) -> dict:
    config = zcore_config(3, 1, 0.0, train_batch_size=GLOBAL_BATCH)
    result = train_zcore(rank, world, "gpt", config, 3, inspect=lambda engine: engine.save_checkpoint(path))
    return result["params"]


def test_a_training_checkpoint_loads_for_inference(tmp_path: Path) -> None:
    ckpt, swap = tmp_path / "ckpt", tmp_path / "swap"
    swap.mkdir()
    params = run_ranks(trained_then_saved, 2, str(ckpt), launcher=True)[0]
    model = make_model("gpt")
    model.load_state_dict(params, strict=False)  # the tied head is the embedding
    tokens, logits = reference("fp32", model)
    got = run_ranks(generate, 2, "nvme", str(swap), "fp32", str(ckpt), launcher=True)
    for rank in got:
        assert torch.equal(rank["tokens"], tokens)
        assert torch.allclose(rank["logits"], logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("extra", [
    {"scheduler": {"type": "WarmupLR", "params": {}}},
    {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}},
])
def test_training_settings_without_an_optimizer_are_refused(extra: dict) -> None:
    with pytest.raises(zcore.ConfigError, match="no optimizer"):
        zcore.initialize(model=make_model("gpt"), config={"train_batch_size": 2, **extra})



def inference_with_model_parameters(rank: int, world: int) -> bool:
    model = make_model("gpt")
    x, _ = global_batch("gpt", 0, 2)
    with torch.no_grad():
        expected = model(x)
    engine, optimizer, _, _ = zcore.initialize(model=model, model_parameters=model.parameters(),
                                               config={"train_batch_size": 2})
    with torch.no_grad():
        same = optimizer is None and torch.equal(engine(x), expected)
    engine.destroy()
    return same


def test_model_parameters_without_an_optimizer_make_an_inference_engine() -> None:
    """As DeepSpeed's scripts pass them whatever the config: noted, not refused."""
    assert run_ranks(inference_with_model_parameters, 1, launcher=False) == [True]
