"""DeepSpeed's ``deepspeed.checkpointing`` names (activation checkpointing),
for code written against DeepSpeed (Megatron-style models call
``deepspeed.checkpointing.checkpoint(layer, *inputs)``).

    import zcore
    zcore.checkpointing.configure(None, checkpoint_in_cpu=True)   # optional
    hidden = zcore.checkpointing.checkpoint(block, hidden, mask)

``checkpoint`` is torch's non-reentrant ``torch.utils.checkpoint``: the
block's activations are recomputed in backward, with the RNG state of the
forward (the same dropout masks), and it works under ZeRO-3's hooks,
``torch.compile`` and gradient accumulation as torch's does. DeepSpeed's
settings, from ``configure`` or the config's ``activation_checkpointing``
section:

- ``checkpoint_in_cpu`` (``cpu_checkpointing``): the block's tensor inputs,
  the one thing a checkpoint keeps, wait for backward in host memory;
- ``partition_activations``, ``contiguous_memory_optimization``
  (``contiguous_checkpointing``), ``number_checkpoints``, ``synchronize``,
  ``profile``: DeepSpeed's own memory and timing machinery for
  checkpoints split across tensor-parallel ranks; accepted, and listed in
  one log line as not applied (zcore keeps a checkpoint's inputs whole).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
import torch.utils.checkpoint

from zcore.errors import ConfigError

log = logging.getLogger("zcore")

__all__ = ["checkpoint", "configure", "is_configured", "non_reentrant_checkpoint", "reset"]

# The config section's names for configure's arguments.
_SECTION_KEYS = {
    "partition_activations": "partition_activations",
    "contiguous_memory_optimization": "contiguous_checkpointing",
    "number_checkpoints": "num_checkpoints",
    "cpu_checkpointing": "checkpoint_in_cpu",
    "synchronize_checkpoint_boundary": "synchronize",
    "profile": "profile",
}
_NOT_APPLIED = ("partition_activations", "contiguous_checkpointing", "num_checkpoints", "synchronize", "profile")


class _Settings:
    configured = False
    checkpoint_in_cpu = False


def configure(
    mpu_: Any,
    deepspeed_config: Union[str, Path, dict, None] = None,
    partition_activations: Optional[bool] = None,
    contiguous_checkpointing: Optional[bool] = None,
    num_checkpoints: Optional[int] = None,
    checkpoint_in_cpu: Optional[bool] = None,
    synchronize: Optional[bool] = None,
    profile: Optional[bool] = None,
) -> None:
    """DeepSpeed's ``deepspeed.checkpointing.configure``: settings for
    ``checkpoint``, from ``deepspeed_config``'s ``activation_checkpointing``
    section (a dict or a JSON file's path), then from the arguments given
    (which win). ``mpu_``: DeepSpeed's model-parallel unit, which zcore does
    not use (tensor parallelism comes as a device mesh)."""
    given = {
        "partition_activations": partition_activations, "contiguous_checkpointing": contiguous_checkpointing,
        "num_checkpoints": num_checkpoints, "checkpoint_in_cpu": checkpoint_in_cpu, "synchronize": synchronize,
        "profile": profile,
    }
    settings = {**_from_config(deepspeed_config), **{k: v for k, v in given.items() if v is not None}}
    _Settings.checkpoint_in_cpu = bool(settings.get("checkpoint_in_cpu", False))
    _Settings.configured = True
    unused = [k for k in _NOT_APPLIED if settings.get(k)]
    if unused or mpu_ is not None:
        log.info(
            "zcore: deepspeed.checkpointing settings not applied (DeepSpeed's machinery for activations split "
            "across tensor-parallel ranks; zcore keeps a checkpoint's inputs whole): %s",
            ", ".join(unused + (["mpu_"] if mpu_ is not None else [])),
        )


def is_configured() -> bool:
    """Whether ``configure`` was called, as DeepSpeed's."""
    return _Settings.configured


def reset() -> None:
    """DeepSpeed frees its contiguous checkpoint buffers here; zcore keeps none."""
    return None


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)``, its activations recomputed in backward
    (torch's non-reentrant checkpoint, the forward's RNG state restored);
    with ``checkpoint_in_cpu``, its tensor inputs kept in host memory
    until then."""
    if not _Settings.checkpoint_in_cpu:
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)
    devices = [a.device if isinstance(a, torch.Tensor) else None for a in args]
    # The copies to the host are in the graph (their backward copies the
    # gradient back), so nothing keeps the device inputs alive for backward.
    on_host = [a.to("cpu") if d is not None and d.type != "cpu" else a for a, d in zip(args, devices)]

    def on_device(*host_args: Any, **kw: Any) -> Any:
        moved = [a.to(d) if d is not None and a.device != d else a for a, d in zip(host_args, devices)]
        return function(*moved, **kw)

    return torch.utils.checkpoint.checkpoint(on_device, *on_host, use_reentrant=False, **kwargs)


non_reentrant_checkpoint = checkpoint  # DeepSpeed's other name; both are non-reentrant here


def _from_config(config: Union[str, Path, dict, None]) -> dict:
    if config is None:
        return {}
    if isinstance(config, (str, Path)):
        try:
            config = json.loads(Path(config).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"deepspeed.checkpointing.configure: cannot read the config {config}: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError(
            f"deepspeed.checkpointing.configure(deepspeed_config=...) takes a dict or a JSON file's path, got "
            f"{type(config).__name__}"
        )
    section = config.get("activation_checkpointing") or {}
    if not isinstance(section, dict):
        raise ConfigError("the config's activation_checkpointing must be a section (a JSON object)")
    return {_SECTION_KEYS[k]: v for k, v in section.items() if k in _SECTION_KEYS}
