"""The model, data and DeepSpeed configs of the DeepSpeed checkpoints in
data/deepspeed_checkpoints, shared by the script that wrote them (under
DeepSpeed, without zcore) and test_deepspeed_checkpoint (under zcore,
without DeepSpeed)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

CHECKPOINTS = Path(__file__).parent / "data" / "deepspeed_checkpoints"
MICRO_BATCH = 4
STEPS_BEFORE_SAVE = 8
STEPS_AFTER_LOAD = 5
TAG = "global_step8"


class TinyMLP(nn.Module):
    """1,397 parameters; no tensor's size divides evenly by 2 or 3 ranks,
    so DeepSpeed's partitions pad and split tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 29)
        self.hidden = nn.Linear(29, 29)
        self.out = nn.Linear(29, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(torch.tanh(self.inp(x)))))


def model(seed: int = 0) -> TinyMLP:
    torch.manual_seed(seed)
    return TinyMLP()


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro-batch at optimizer step ``step`` (counted from 0 for the run that saved)."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(MICRO_BATCH, 12, generator=generator), torch.randn(MICRO_BATCH, 5, generator=generator)


def loss_of(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output.float(), target)


_BASE = {
    "train_micro_batch_size_per_gpu": MICRO_BATCH,
    "gradient_accumulation_steps": 1,
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01, "torch_adam": True},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 10},
    },
    "gradient_clipping": 1.0,  # both tools' default, written out
    "steps_per_print": 1000,
}
# A scale high enough that the first steps overflow and are skipped, and a
# short window, so that the saved scaler is neither the initial one nor still.
_FP16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 18, "loss_scale_window": 3,
         "hysteresis": 2, "min_loss_scale": 1}


def _config(stage: int, precision: str, offload: bool = False, adam: str = "AdamW") -> dict:
    config = copy.deepcopy(_BASE)
    config["zero_optimization"] = {"stage": stage}
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if precision == "fp16":
        config["fp16"] = dict(_FP16)
    elif precision == "bf16":
        config["bf16"] = {"enabled": True}
    if precision != "fp32":  # DeepSpeed reduces gradients in the compute dtype by default, zcore in fp32
        config["communication_data_type"] = precision
    if adam == "Adam":
        config["optimizer"]["type"] = "Adam"
        config["optimizer"]["params"]["adam_w_mode"] = False
    return config


# name: (world size, DeepSpeed config)
FIXTURES = {
    "z1_fp32_ws2": (2, _config(1, "fp32", adam="Adam")),
    "z1_bf16_ws2": (2, _config(1, "bf16")),
    "z1_fp16_ws2": (2, _config(1, "fp16")),
    "z2_fp32_ws2": (2, _config(2, "fp32")),
    "z2_bf16_ws2": (2, _config(2, "bf16")),
    "z2_fp16_ws2": (2, _config(2, "fp16")),
    "z2_fp32_offload_ws2": (2, _config(2, "fp32", offload=True)),
    "z3_fp32_ws2": (2, _config(3, "fp32")),
    "z3_bf16_ws2": (2, _config(3, "bf16")),
    "z3_fp16_ws2": (2, _config(3, "fp16")),
    "z3_bf16_offload_ws2": (2, _config(3, "bf16", offload=True)),
    "z2_fp16_ws3": (3, _config(2, "fp16")),
    "z3_fp32_ws3": (3, _config(3, "fp32")),
}
