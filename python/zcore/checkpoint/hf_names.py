"""The model's names for the tensors of a Hugging Face checkpoint, as
transformers' ``from_pretrained`` gives them.

transformers 5 saves some models in an older layout than the one they
compute in, and converts at load time with the model's conversion mapping:
keys are renamed (a ViT's ``encoder.layer.0.attention.attention.query`` is
its ``layers.0.attention.q_proj``), and some tensors are made of several
(Mixtral's per-expert ``w1`` and ``w3`` weights are one stacked
``experts.gate_up_proj``). Its own ``save_pretrained`` writes that older
layout again. zcore applies the same mapping with transformers' own
functions: a renamed tensor is read by element ranges like any other; a
converted one is built whole in host memory from its sources by
transformers' operations (the latest two are kept: a fused weight's and its
bias's conversions are read in turn; an older one read again is built
again) and its ranges are cut from there.

Without transformers, or for a model that is not a transformers
``PreTrainedModel``, the names are the file's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from copy import deepcopy
from typing import Any, Optional

import torch

from zcore.errors import CheckpointError, CheckpointMismatchError

KEPT = 2  # conversions whose tensors stay in memory for their next reads


class CheckpointNames:
    """Which file key, or which conversion, gives each model key."""

    def __init__(
        self,
        module: torch.nn.Module,
        file_keys: Iterable[str],
        model_shapes: dict[str, tuple[int, ...]],
        read_whole: Callable[[str], torch.Tensor],
    ) -> None:
        """``model_shapes``: the model's state-dict keys and their shapes;
        ``read_whole(file_key)``: a file tensor, whole."""
        self._module = module
        self._shapes = model_shapes
        self.file_key: dict[str, str] = {}  # model-side name -> file key (renamed, or as it is)
        # model key -> the conversion that makes it, holding its sources' readers
        # (never run itself: transformers' convert consumes them; a copy is).
        self._converters: dict[str, Any] = {}
        # The latest conversions' tensors, newest last: a fused weight's and
        # its bias's conversions are read in turn (gate, bias, up, bias).
        self._built: list[tuple[Any, dict[str, torch.Tensor]]] = []
        transforms = _conversions(module)
        if transforms is None:
            self.file_key = {k: k for k in file_keys}
            return
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        prefix = getattr(module, "base_model_prefix", None)
        present = dict.fromkeys(model_shapes, True)  # what rename_source_key asks of the model's state dict
        # In transformers' order: a conversion stacks its sources as they come.
        for key in sorted(file_keys, key=dot_natural_key):
            renamed, pattern = rename_source_key(key, renamings, converters, prefix, present)
            if renamed not in present and key in present:  # as transformers: the key was right as it was
                renamed, pattern = rename_source_key(key, [], [], prefix, present)
            if renamed not in present:
                self.file_key.setdefault(key, key)  # unexpected: reported under its own name
            elif pattern is None:
                self.file_key.setdefault(renamed, key)
            else:
                converter = self._converters.get(renamed)
                if converter is None:
                    converter = deepcopy(by_pattern[pattern])
                    for target in _targets(converter, renamed):
                        self._converters[target] = converter
                converter.add_tensor(renamed, key, pattern, lambda key=key: read_whole(key))

    def keys(self) -> list[str]:
        """Every model-side name the files give (or, where not the model's, their own)."""
        return list(self.file_key) + [k for k in self._converters if k not in self.file_key]

    def is_converted(self, key: str) -> bool:
        return key in self._converters and key not in self.file_key

    def whole(self, key: str) -> torch.Tensor:
        """A converted tensor, whole: built with the tensors it shares a
        conversion with, which are kept for the next reads (the latest
        KEPT conversions; an older one is built again when read again)."""
        converter = self._converters[key]
        built = next((out for c, out in self._built if c is converter), None)
        if built is None:
            del self._built[: max(0, len(self._built) - KEPT + 1)]  # before building: bounded memory
            built = self._convert(converter, key)
            self._built.append((converter, built))
        value = built.get(key)
        if value is None:
            raise CheckpointError(f"transformers' conversion of the checkpoint's tensors gave no {key!r}")
        expected = tuple(self._shapes[key])
        if tuple(value.shape) != expected:
            raise CheckpointMismatchError(
                f"the checkpoint's tensors converted into {key!r} have shape {list(value.shape)}, the model's is "
                f"{list(expected)}: the weights are of another model; build the model from the config saved "
                "with them", reshaped=[key],
            )
        return value

    def _convert(self, converter: Any, key: str) -> dict[str, torch.Tensor]:
        model = _WholeShapes(self._module, self._shapes)
        try:
            out = deepcopy(converter).convert(key, model=model, config=getattr(self._module, "config", None))
        except Exception as exc:
            raise CheckpointError(
                f"transformers' conversion of the checkpoint's tensors into {key!r} failed "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        return {k: v.contiguous() for k, v in out.items()}


class _WholeShapes:
    """The model as a conversion sees it: its parameters at their whole
    shapes (meta tensors; a ZeRO-3 parameter is a placeholder between uses,
    and an operation such as transformers' Split sizes its outputs from the
    parameters), everything else the model's own."""

    def __init__(self, module: torch.nn.Module, shapes: dict[str, tuple[int, ...]]) -> None:
        self._module = module
        self._shapes = shapes

    def get_parameter(self, target: str) -> torch.Tensor:
        if target in self._shapes:
            return torch.empty(self._shapes[target], dtype=self._module.get_parameter(target).dtype, device="meta")
        return self._module.get_parameter(target)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _conversions(module: torch.nn.Module) -> Optional[list]:
    """The model's transformers conversion mapping; None where there is
    none to apply (no transformers, or not one of its models)."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # transformers is optional; before 5 it had no conversion mappings
        return None
    if not isinstance(module, PreTrainedModel):
        return None
    return get_model_conversion_mapping(module) or None


def _targets(converter: Any, renamed: str) -> list[str]:
    """The model keys a conversion registered under ``renamed`` makes: as
    transformers' ``WeightConverter.convert`` names its outputs, the
    first target pattern in ``renamed`` replaced by each target pattern."""
    full = renamed.replace("*.", "0.")
    first = converter.target_patterns[0]
    if first not in full:
        return [renamed]
    head, _, tail = full.partition(first)
    return [head + target + tail for target in converter.target_patterns]
