"""ZeRO-3 ranks generate in lockstep.

Every forward of a ZeRO-3 model gathers parameters with collectives, so a
rank whose sequences are finished must keep running forwards until every
rank's are. Hugging Face's ``generate(synced_gpus=...)`` does exactly that,
and turns it on by itself only for DeepSpeed ZeRO-3 and FSDP; for any other
engine its default is off, and the first rank to finish leaves the others
waiting in an all-gather until the process group times out.

zcore sets that default on the model itself: ``model.generate`` becomes the
class's ``generate`` with ``synced_gpus=True`` unless the caller passes a
value. Only the public ``synced_gpus`` argument is relied on, so any model
whose ``generate`` takes it (transformers' GenerationMixin and look-alikes)
is covered, and nothing in transformers is patched.
"""

from __future__ import annotations

import inspect
import types
from typing import Any

import torch


def sync_generation(model: torch.nn.Module) -> None:
    """Call for a ZeRO-3 model trained on more than one rank."""
    generate = getattr(type(model), "generate", None)
    if not callable(generate):
        return
    try:
        takes_sync = "synced_gpus" in inspect.signature(generate).parameters
    except (TypeError, ValueError):  # no introspectable signature: not transformers' generate
        return
    if takes_sync:
        model.generate = types.MethodType(_synced_generate, model)


def _synced_generate(model: torch.nn.Module, *args: Any, synced_gpus: Any = None, **kwargs: Any) -> Any:
    # None is transformers' "decide for me": decided here, since it cannot see zcore.
    return type(model).generate(model, *args, synced_gpus=True if synced_gpus is None else synced_gpus, **kwargs)
