"""DeepSpeed's ``deepspeed.utils.zero_to_fp32`` names, over zcore's
checkpoints: the whole model's fp32 weights from a sharded checkpoint,
offline, in one process (zcore.checkpoint.consolidate does the work).

    from zcore.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    state_dict = get_fp32_state_dict_from_zero_checkpoint("checkpoints")   # its 'latest' tag
    model.load_state_dict(state_dict)

A DeepSpeed checkpoint is turned into a zcore one first, with
``zcore convert --from deepspeed SRC DST``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional, Union

import torch

from zcore.checkpoint.consolidate import consolidate, consolidated_state_dict
from zcore.checkpoint.files import size_in_bytes
from zcore.errors import InvalidArgumentError

log = logging.getLogger("zcore")

__all__ = [
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
]


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: Union[str, Path], tag: Optional[str] = None, exclude_frozen_parameters: bool = False,
    lazy_mode: bool = False,
) -> dict[str, torch.Tensor]:
    """The model's state dict from checkpoint ``checkpoint_dir`` (its
    ``tag``, default the one ``latest`` names), floating-point tensors in
    fp32, on the CPU: what ``model.state_dict()`` held, tied parameters
    under each name; ``exclude_frozen_parameters`` leaves frozen parameters
    out. Memory: the whole model (``zcore consolidate`` streams it to files
    instead). ``lazy_mode`` (DeepSpeed's tensors read on access) is not
    zcore's: refused."""
    if lazy_mode:
        raise InvalidArgumentError(
            "get_fp32_state_dict_from_zero_checkpoint(lazy_mode=True) is DeepSpeed's; zcore reads the tensors "
            "at once. For a model too large for memory, write the weights to files tensor by tensor with "
            "convert_zero_checkpoint_to_fp32_state_dict (or `zcore consolidate`)",
            argument="lazy_mode",
        )
    return consolidated_state_dict(checkpoint_dir, tag, frozen=not exclude_frozen_parameters)


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: Union[str, Path], output_dir: Union[str, Path], max_shard_size: Union[int, str] = "5GB",
    safe_serialization: bool = False, tag: Optional[str] = None, exclude_frozen_parameters: bool = False,
) -> list[Path]:
    """Writes the model's fp32 state dict from ``checkpoint_dir`` into
    ``output_dir`` as safetensors files of at most ``max_shard_size`` (with
    an index when there are several), streamed tensor by tensor; returns
    the files. zcore writes safetensors whatever ``safe_serialization``
    says (it never pickles). ``exclude_frozen_parameters`` is not offered
    when writing files: refused."""
    if exclude_frozen_parameters:
        raise InvalidArgumentError(
            "convert_zero_checkpoint_to_fp32_state_dict(exclude_frozen_parameters=True): zcore writes every "
            "tensor of the model; load the result with strict=False and drop what you do not want, or use "
            "get_fp32_state_dict_from_zero_checkpoint(..., exclude_frozen_parameters=True)",
            argument="exclude_frozen_parameters",
        )
    if not safe_serialization:
        log.info("zcore: convert_zero_checkpoint_to_fp32_state_dict writes safetensors files (zcore never pickles)")
    limit = size_in_bytes(max_shard_size) if isinstance(max_shard_size, str) else max_shard_size
    return consolidate(checkpoint_dir, output_dir, tag=tag, max_shard_bytes=limit)


def load_state_dict_from_zero_checkpoint(
    model: torch.nn.Module, checkpoint_dir: Union[str, Path], tag: Optional[str] = None
) -> torch.nn.Module:
    """Moves ``model`` (a plain module, not an engine's) to the CPU, loads
    the checkpoint's fp32 weights into it and returns it, as DeepSpeed's
    does: not strictly (a key either side lacks is left as it is, and named
    in a warning)."""
    if not isinstance(model, torch.nn.Module):
        raise InvalidArgumentError(
            f"load_state_dict_from_zero_checkpoint takes a torch.nn.Module, got {type(model).__name__}",
            argument="model",
        )
    model = model.cpu()
    missing, unexpected = model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag),
                                                strict=False)
    if missing or unexpected:
        log.warning("zcore: load_state_dict_from_zero_checkpoint: %d keys of the model not in the checkpoint %s, "
                    "%d in the checkpoint not in the model %s", len(missing), missing[:5], len(unexpected),
                    unexpected[:5])
    return model
