"""ZeRO-3 parameters as code outside zcore sees them: counted whole, and
never handed out empty in a state dict.

Between uses a ZeRO-3 parameter holds an empty placeholder (zcore.zero3.sharded_group),
so ``p.numel()`` would be 0 and everything that counts parameters with it
(``model.num_parameters()`` in Hugging Face, parameter-count logs, FLOP
estimates) would see an empty model. The parameter's class becomes
``ShardedParameter``, which answers ``numel()`` with the whole parameter's
count, as FSDP2's DTensor parameters do; its storage, shape and every
operator are left as they are, so code that reads values still fails on the
placeholder rather than computing with fake ones.

``model.state_dict()`` would hold those placeholders: 0-element tensors that
``save_pretrained`` or ``torch.save`` write without complaint, and that only
fail when loaded. A module with a parameter not gathered now refuses to give
its state dict, and names what gives the whole weights instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from zcore.errors import InvalidStateError
from zcore.parallel.dtensor import is_dtensor

if TYPE_CHECKING:
    from zcore.zero3.sharded_group import ShardedGroup


# Each sharded parameter's whole element count, kept by zcore rather than
# on the Parameter (a copy or an unpickled parameter is not in it).
_WHOLE_NUMEL: WeakIdKeyDictionary = WeakIdKeyDictionary()


class ShardedParameter(torch.nn.Parameter):
    # Parameter disables __torch_function__ for speed; so does this subclass
    # (inherited), so operators see a plain Parameter.

    def numel(self) -> int:
        whole = _WHOLE_NUMEL.get(self)
        return super().numel() if whole is None else whole

    nelement = numel


def mark_sharded(groups: Iterable[ShardedGroup]) -> None:
    """The groups' parameters count their whole elements from now on,
    whatever they hold. After the groups are filled: materialising a meta
    parameter (torch.utils.swap_tensors) replaces its class."""
    for group in groups:
        for param, numel in zip(group.params, group.numels):
            if is_dtensor(param):  # counts its whole elements already
                continue
            if not isinstance(param, ShardedParameter):
                param.__class__ = ShardedParameter
            _WHOLE_NUMEL[param] = numel


def refuse_empty_state_dicts(model: torch.nn.Module) -> list:
    """Hooks (their handles) that make ``state_dict()`` of a module with a
    parameter not gathered now raise instead of returning a placeholder."""
    return [
        module.register_state_dict_post_hook(_refuse_if_not_gathered)
        for module in model.modules()
        if any(isinstance(p, ShardedParameter) for p in module._parameters.values())
    ]


def _refuse_if_not_gathered(module: torch.nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    for name, p in module._parameters.items():
        value = state_dict.get(prefix + name)
        # keep_vars=True hands out the parameters themselves (zcore's
        # checkpoints read them so), not values that could be written.
        if value is None or value is p or not isinstance(p, ShardedParameter):
            continue
        if p.data.numel() != p.numel():
            raise InvalidStateError(
                f"state_dict() of a ZeRO-3 model: parameter {prefix + name!r} is sharded across ranks "
                "and not gathered now, so the state dict would hold an empty tensor for it (and "
                "save_pretrained or torch.save would write it). For the whole weights, call on every "
                "rank: engine.full_state_dict() (rank 0 receives them), zcore.save_pretrained(engine, "
                "directory) for a Hugging Face directory, or read the state dict inside "
                "`with zcore.GatheredParameters(list(model.parameters())):`"
            )
