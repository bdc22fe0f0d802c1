"""The engine's state in the layout PyTorch's DCP recipes save, both ways.

``dcp.save({"model": model_sd, "optimizer": optim_sd})``, with the state
dicts torch.distributed.checkpoint.state_dict.get_state_dict returns for an
FSDP2 model; DCP joins the nesting into keys:

- ``model.<state_dict key>``: every parameter and persistent buffer; trained
  parameters as their fp32 master weights (what FSDP2 keeps with fp32
  parameters), a tied parameter under each of its keys;
- ``optimizer.state.<parameter name>.<state>``: Adam's ``step`` (a float32
  scalar tensor, one for the whole parameter), ``exp_avg`` and
  ``exp_avg_sq`` (shaped like it); a parameter's first name, as
  get_optimizer_state_dict names it;
- ``optimizer.param_groups.<i>.<key>``: each group's hyper-parameters under
  torch.optim.Adam's keys (zcore's optimizers keep the same), and
  ``params``, the names of its parameters.

Values shaped like a parameter are this rank's flat ranges
(zcore.checkpoint.dcp_planners); the step and the groups are whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from zcore.checkpoint import training_state
from zcore.checkpoint.dcp_planners import KeyPath, RangedTensor, flat_key
from zcore.checkpoint.layout import TRAINED, EngineLayout, Slot, mismatch
from zcore.checkpoint.slot_values import SlotValues
from zcore.errors import CheckpointError, CheckpointMismatchError

MODEL, OPTIMIZER, STATE, GROUPS = "model", "optimizer", "state", "param_groups"
_KINDS = ("Adam", "AdamW")  # optimizers whose state DCP's layout names (zcore.checkpoint.training_state.optimizer_kind)
# Group keys loaded from a checkpoint: the update's values; flags that change
# the update rule must match; the others (foreach, fused, ...) stay the engine's.
_APPLIED = ("lr", "betas", "eps", "weight_decay")
_MATCHING = ("amsgrad", "maximize", "decoupled_weight_decay")


def check_optimizer_kind(inner: torch.optim.Optimizer, doing: str) -> str:
    kind = training_state.optimizer_kind(inner)
    if kind not in _KINDS:
        raise CheckpointError(
            f"{doing}: DCP's layout holds Adam's and AdamW's states; this engine's optimizer is {kind}. "
            "Save a zcore checkpoint (engine.save_checkpoint) instead"
        )
    return kind


# Saving.
def saved_state(engine: Any, layout: EngineLayout) -> tuple[dict, dict[KeyPath, RangedTensor]]:
    """(the nested state dict of whole values, the ranged values by path)
    that this rank saves."""
    values = SlotValues(engine)
    ranged: dict[KeyPath, RangedTensor] = {}
    keys: dict[str, list[str]] = {}  # tensor name -> its state dict keys (tied parameters have several)
    for key, name in layout.keys.items():
        keys.setdefault(name, []).append(key)

    def add(path: KeyPath, shape: tuple[int, ...], start: int, data: torch.Tensor) -> None:
        ranged.setdefault(path, RangedTensor(shape, data.dtype)).ranges.append((start, data.reshape(-1)))

    states: dict[str, dict] = {}
    for slot, data, state in values.trained(layout.slots_of(TRAINED)):
        if not slot.saves:
            continue
        state = state or {}
        if values.swapped:  # read from NVMe, valid until the next slot's: DCP writes after planning
            data, state = data.clone(), {k: v.clone() for k, v in state.items()}
        shape = layout.tensors[slot.name].shape
        for key in keys[slot.name]:
            add((MODEL, key), shape, slot.start, data)
        for k, v in state.items():
            if k == "step":
                states[slot.name] = {"step": v.detach().to("cpu", copy=True)}
            else:
                add((OPTIMIZER, STATE, slot.name, k), shape, slot.start, v)
    for slot in layout.slots:
        if slot.saves and layout.tensors[slot.name].role != TRAINED:
            data = values.frozen(slot)
            if slot.group is not None and not slot.group.in_memory:
                data = data.clone()  # a slice of the one shard SlotValues caches
            for key in keys[slot.name]:
                add((MODEL, key), layout.tensors[slot.name].shape, slot.start, data)
    state_dict: dict[str, Any] = {}
    if engine.optimizer is not None:
        inner = engine.optimizer.inner
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(names)}
                  for g, names in zip(inner.param_groups, layout.groups)]
        state_dict[OPTIMIZER] = {STATE: states, GROUPS: groups}
    return state_dict, ranged


# Loading.
@dataclass
class LoadTargets:
    """What this rank reads of a checkpoint, checked against the engine by
    its metadata: the state dict DCP fills (steps, param groups' values)
    and the buffers of this rank's ranges."""

    state_dict: dict = field(default_factory=dict)
    ranged: dict[KeyPath, RangedTensor] = field(default_factory=dict)
    state_keys: dict[str, list[str]] = field(default_factory=dict)  # trained name -> its ranged state keys
    group_keys: list[str] = field(default_factory=list)  # flat keys of the groups' values

    def add_range(self, path: KeyPath, shape: tuple[int, ...], slot: Slot) -> None:
        """A buffer for ``slot``'s range of the value at ``path``, in the slot's dtype
        (DCP's copy casts what was saved to it, as a load into FSDP2 would)."""
        target = self.ranged.setdefault(path, RangedTensor(shape, slot.data.dtype))
        target.ranges.append((slot.start, torch.empty(slot.stop - slot.start, dtype=slot.data.dtype)))

    def read(self, name: str, start: int, stop: int, state: Optional[str] = None) -> torch.Tensor:
        """Elements [start, stop) of ``name`` (or of its optimizer state ``state``), as read."""
        target = self.ranged[(MODEL, name) if state is None else (OPTIMIZER, STATE, name, state)]
        for first, values in target.ranges:
            if first <= start and stop <= first + values.numel():
                return values[start - first : stop - first]
        raise KeyError(f"{name}[{start}:{stop}] was not read")

    def step(self, name: str) -> Optional[torch.Tensor]:
        """Adam's step of ``name``; None where it never stepped."""
        return self.state_dict.get(OPTIMIZER, {}).get(STATE, {}).get(name, {}).get("step")


def load_targets(metadata: Metadata, layout: EngineLayout, optimizer: bool, checkpoint: str) -> LoadTargets:
    """Raises CheckpointMismatchError unless the checkpoint holds the
    model's tensors of the same shapes (and, with ``optimizer``, states for
    its trained ones), then allocates what this rank reads."""
    entries = metadata.state_dict_metadata
    _check_model(entries, layout, checkpoint)
    targets = LoadTargets()
    for slot in layout.slots:
        targets.add_range((MODEL, slot.name), layout.tensors[slot.name].shape, slot)
    if not optimizer:
        return targets
    groups = _group_keys(entries, layout, checkpoint)
    states: dict[str, dict] = {}
    for name in dict.fromkeys(s.name for s in layout.slots_of(TRAINED)):
        found = _state_entries(entries, name, layout.tensors[name].shape, checkpoint)
        if "step" in found:
            states[name] = {"step": torch.empty((), dtype=found["step"].properties.dtype)}
        targets.state_keys[name] = [k for k in found if k != "step"]
    for slot in layout.slots_of(TRAINED):
        for k in targets.state_keys[slot.name]:
            targets.add_range((OPTIMIZER, STATE, slot.name, k), layout.tensors[slot.name].shape, slot)
    targets.group_keys = groups
    targets.state_dict = {OPTIMIZER: {STATE: states, GROUPS: _nested_groups(groups)}}
    return targets


def _state_entries(
    entries: dict, name: str, shape: tuple[int, ...], checkpoint: str
) -> dict[str, TensorStorageMetadata]:
    """The optimizer states the checkpoint holds for trained tensor ``name``, by state key."""
    prefix = flat_key((OPTIMIZER, STATE, name)) + "."
    found = {key[len(prefix):]: md for key, md in entries.items()
             if key.startswith(prefix) and "." not in key[len(prefix):]}
    for k, md in found.items():
        expected = () if k == "step" else shape
        if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != expected:
            size = list(md.size) if isinstance(md, TensorStorageMetadata) else "not a tensor"
            raise CheckpointMismatchError(
                f"DCP checkpoint {checkpoint}: {prefix + k!r} is {size}, the model's {name} needs "
                f"{list(expected)}; load the checkpoint into the model and optimizer it was saved from"
            )
    return found


def _check_model(entries: dict, layout: EngineLayout, checkpoint: str) -> None:
    prefix = MODEL + "."
    saved = {key[len(prefix):]: md for key, md in entries.items() if key.startswith(prefix)}
    if not saved:
        raise CheckpointError(
            f"DCP checkpoint {checkpoint} holds no 'model.' entries (it has {sorted(entries)[:6]}): zcore reads "
            "checkpoints saved as dcp.save({\"model\": model_state_dict, \"optimizer\": optim_state_dict})"
        )
    if any(info.parts is not None for info in layout.tensors.values()):
        raise CheckpointError("loading a DCP checkpoint into a tensor-parallel engine is not supported")
    missing = [k for k in layout.keys if k not in saved]
    unexpected = [k for k in saved if k not in layout.keys]
    reshaped = []
    for key, name in layout.keys.items():
        md, shape = saved.get(key), layout.tensors[name].shape
        if md is not None and (not isinstance(md, TensorStorageMetadata) or tuple(md.size) != shape):
            found = list(md.size) if isinstance(md, TensorStorageMetadata) else "not a tensor"
            reshaped.append(f"{key}: checkpoint {found}, model {list(shape)}")
    if missing or unexpected or reshaped:
        raise CheckpointMismatchError(
            f"DCP checkpoint {checkpoint} is of another model; its 'model' entries " + mismatch(missing, unexpected, reshaped)
            + ". Build the model the checkpoint was saved from (the same parameter names and shapes)",
            missing=missing, unexpected=unexpected, reshaped=reshaped,
        )


def _group_keys(entries: dict, layout: EngineLayout, checkpoint: str) -> list[str]:
    """The flat keys of every param group's values (``optimizer.param_groups.<i>.<key>``)."""
    keys = []
    count = 0
    while any(k.startswith(flat_key((OPTIMIZER, GROUPS, count)) + ".") for k in entries):
        count += 1
    for i in range(count):
        prefix = flat_key((OPTIMIZER, GROUPS, i)) + "."
        keys += [k for k in entries if k.startswith(prefix) and "." not in k[len(prefix):]]
    if count == 0:
        raise CheckpointMismatchError(
            f"DCP checkpoint {checkpoint} holds no optimizer state (no 'optimizer.param_groups' entries); "
            "load it with load_optimizer_states=False to take the model's weights only"
        )
    if count != len(layout.groups):
        raise CheckpointMismatchError(
            f"DCP checkpoint {checkpoint} has {count} optimizer param groups, this engine {len(layout.groups)}; "
            "build the optimizer with the same parameter groups"
        )
    return keys


def _nested_groups(keys: list[str]) -> list[dict]:
    """The param groups' part of the state dict DCP fills: a placeholder per value."""
    groups: list[dict] = []
    for key in keys:
        _, _, i, name = key.split(".", 3)
        while len(groups) <= int(i):
            groups.append({})
        groups[int(i)][name] = None
    return groups


def loaded_hyperparameters(
    inner: torch.optim.Optimizer, layout: EngineLayout, loaded: dict[str, object], checkpoint: str
) -> list[dict]:
    """Per group, the hyper-parameters to set from the checkpoint's groups
    (``loaded``: by flat key), checked against the engine's optimizer."""
    out = []
    for i, (group, names) in enumerate(zip(inner.param_groups, layout.groups)):
        prefix = flat_key((OPTIMIZER, GROUPS, i)) + "."
        saved = {key[len(prefix):]: v for key, v in loaded.items() if key.startswith(prefix)}
        params = saved.get("params")
        if not isinstance(params, list) or set(params) != set(names):
            theirs = set(params) if isinstance(params, (list, tuple)) else set()
            raise CheckpointMismatchError(
                f"DCP checkpoint {checkpoint}: optimizer param group {i} holds other parameters than this engine's "
                f"(only in the checkpoint: {sorted(map(str, theirs - set(names)))[:5]}, only in the engine: "
                f"{sorted(set(names) - theirs)[:5]}); build the optimizer with the same parameter groups"
            )
        for key in _MATCHING:
            if key in saved and key in group and bool(saved[key]) != bool(group[key]):
                raise CheckpointMismatchError(
                    f"DCP checkpoint {checkpoint}: optimizer param group {i} has {key}={saved[key]!r}, this "
                    f"engine's {type(inner).__name__} {key}={group[key]!r}; configure the optimizer the checkpoint "
                    "was saved with (decoupled_weight_decay=True is AdamW)"
                )
        out.append({k: _json(saved[k]) for k in _APPLIED if k in saved and k in group})
    try:
        training_state.check_hyperparameters(inner, out)
    except ValueError as exc:
        raise CheckpointMismatchError(f"DCP checkpoint {checkpoint}: optimizer param groups: {exc}") from None
    return out


def _json(value: object) -> object:
    """A hyper-parameter as zcore's checks take it (JSON: lists, numbers)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, tuple):
        return [_json(v) for v in value]
    return value
