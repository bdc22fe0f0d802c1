"""zcore.checkpointing, DeepSpeed's deepspeed.checkpointing: a block run
through ``checkpoint`` trains exactly as without it (dropout included: the
recompute replays the forward's RNG state) at stage 3 on two ranks, with
keyword arguments, and with the settings ``configure`` reads from a
config's activation_checkpointing section."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import zcore
from distributed import run_ranks


class Block(nn.Module):
    calls = 0  # forwards run, recomputes included

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        Block.calls += 1
        return self.drop(torch.tanh(self.fc(x))) * scale


class Net(nn.Module):
    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(8, 1)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = zcore.checkpointing.checkpoint(block, x, scale=0.9) if self.checkpointed else block(x, scale=0.9)
        return self.head(x)


def train(rank: int, world: int, checkpointed: bool, config_path: str) -> dict:
    if checkpointed:
        zcore.checkpointing.configure(None, deepspeed_config=config_path)
    torch.manual_seed(0)
    model = Net(checkpointed)
    engine, *_ = zcore.initialize(model=model, config={
        "train_batch_size": 8, "gradient_clipping": 0, "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    torch.manual_seed(100 + rank)  # the same dropout draws in both runs
    losses = []
    for step in range(3):
        g = torch.Generator().manual_seed(step * 10 + rank)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    weights = engine.full_state_dict()
    engine.destroy()
    return {"losses": losses, "weights": weights, "configured": zcore.checkpointing.is_configured(),
            "calls": Block.calls}


def test_checkpointed_blocks_train_exactly_as_without(tmp_path):
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"activation_checkpointing": {
        "partition_activations": True, "cpu_checkpointing": True, "number_checkpoints": 3}}))
    plain = run_ranks(train, 2, False, str(config))
    checkpointed = run_ranks(train, 2, True, str(config))
    for rank in range(2):
        assert checkpointed[rank]["configured"] and not plain[rank]["configured"]
        assert checkpointed[rank]["losses"] == plain[rank]["losses"], rank
        assert checkpointed[rank]["calls"] == 2 * plain[rank]["calls"] == 2 * 3 * 3  # each block recomputed
    for name, value in plain[0]["weights"].items():
        assert torch.equal(checkpointed[0]["weights"][name], value), name


def test_a_config_that_is_not_one_is_refused(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(zcore.ConfigError, match="cannot read the config"):
        zcore.checkpointing.configure(None, deepspeed_config=bad)
    with pytest.raises(zcore.ConfigError, match="must be a section"):
        zcore.checkpointing.configure(None, deepspeed_config={"activation_checkpointing": 1})
