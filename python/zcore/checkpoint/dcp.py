"""``save_dcp`` and ``load_dcp``: the model and optimizer state as a
torch.distributed.checkpoint (DCP) checkpoint, in the layout FSDP2 runs save
(zcore.checkpoint.dcp_state), at any world size on either side.

Each rank writes only its own ranges (zcore.checkpoint.dcp_planners) and
reads only the bytes of the saved chunks that overlap them
(zcore.checkpoint.dcp_reader). A load is two-phased as
zcore's own (zcore.checkpoint.load): every rank checks the checkpoint's
metadata against the engine, reads into fresh buffers and checks what it
read; only once every rank succeeded does the engine's state change.

DCP's checkpoint holds no loss scaler, learning-rate scheduler or step
counters (PyTorch's recipes save those as entries of their own): the
engine keeps its own. DCP reads its ``.metadata`` file with pickle, so
load only checkpoints you trust.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata

from zcore.checkpoint import training_state
from zcore.checkpoint.dcp_planners import RangedLoadPlanner, RangedSavePlanner
from zcore.checkpoint.dcp_reader import PartialReader
from zcore.checkpoint.dcp_state import (
    LoadTargets, check_optimizer_kind, load_targets, loaded_hyperparameters, saved_state,
)
from zcore.checkpoint.full_state import refuse_model_parallel
from zcore.checkpoint.layout import TRAINED, EngineLayout, engine_layout
from zcore.checkpoint.load import Staged, as_checkpoint_error, commit_when_all_staged, stage_nvme
from zcore.checkpoint.slot_values import SlotValues
from zcore.comm import collectives as comm
from zcore.errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError

log = logging.getLogger("zcore")


def save_dcp(engine: Any, directory: str | Path) -> None:
    """Writes the engine's model (fp32 master weights, frozen parameters,
    buffers) and Adam's states to ``directory`` as
    ``dcp.save({"model": ..., "optimizer": ...})`` of an FSDP2 run would;
    call it on every rank. FSDP2 (or zcore, at any world size) loads it with
    dcp.load of its get_state_dict and set_state_dict."""
    engine.lifetime.check_usable()
    refuse_model_parallel(engine, "zcore.checkpoint.save_dcp")
    engine._finish_step()
    layout = engine_layout(engine)
    state_dict, ranged, failure = None, None, None
    try:
        if engine.optimizer is not None:
            check_optimizer_kind(engine.optimizer.inner, f"saving a DCP checkpoint to {directory}")
        state_dict, ranged = saved_state(engine, layout)
    except BaseException as exc:  # noqa: BLE001 - every rank must learn of it before DCP's collectives
        failure = as_checkpoint_error(exc, f"saving a DCP checkpoint to {directory}")
    comm.raise_if_any_failed(failure, f"saving a DCP checkpoint to {directory}", CheckpointError)
    try:
        dcp.save(state_dict, checkpoint_id=str(directory), planner=RangedSavePlanner(ranged))
    except Exception as exc:  # DCP raises on every rank when one fails
        raise CheckpointError(f"writing DCP checkpoint {directory} failed: {str(exc)[:2000]}") from exc


def load_dcp(engine: Any, directory: str | Path, load_optimizer_states: bool = True) -> None:
    """Loads a DCP checkpoint saved as ``dcp.save({"model": ..., "optimizer":
    ...})`` of get_state_dict's state dicts (an FSDP2 run's, or
    ``save_dcp``'s) at any world size into ``engine``, of any stage; call it
    on every rank. ``load_optimizer_states=False`` takes the weights only.
    A checkpoint of another model or optimizer raises
    CheckpointMismatchError, naming the entries, before anything changes."""
    engine.lifetime.check_usable()
    refuse_model_parallel(engine, "zcore.checkpoint.load_dcp")
    engine._finish_step()
    layout = engine_layout(engine)
    checkpoint = str(directory)
    optimizer = load_optimizer_states and engine.optimizer is not None
    targets, failure = None, None
    try:
        if optimizer:
            check_optimizer_kind(engine.optimizer.inner, f"loading DCP checkpoint {checkpoint}")
        targets = load_targets(_read_metadata(checkpoint), layout, optimizer, checkpoint)
    except BaseException as exc:  # noqa: BLE001 - every rank must learn of it before DCP's collectives
        failure = as_checkpoint_error(exc, f"loading DCP checkpoint {checkpoint}")
    comm.raise_if_any_failed(failure, f"loading DCP checkpoint {checkpoint}", CheckpointError)
    planner = RangedLoadPlanner(targets.ranged, checkpoint)
    try:
        dcp.load(targets.state_dict, storage_reader=PartialReader(checkpoint), planner=planner)
    except Exception as exc:  # DCP raises on every rank when one fails
        raise CheckpointError(f"reading DCP checkpoint {checkpoint} failed: {str(exc)[:2000]}") from exc
    staged, failure = None, None
    try:
        staged = _stage(engine, layout, targets, planner.loaded_bytes if optimizer else None, checkpoint)
    except BaseException as exc:  # noqa: BLE001 - every rank must learn of it
        failure = as_checkpoint_error(exc, f"loading DCP checkpoint {checkpoint}")
    commit_when_all_staged(engine, staged, failure, f"loading DCP checkpoint {checkpoint}")
    log.info("zcore: loaded DCP checkpoint %s%s", checkpoint, "" if optimizer else " (weights only)")


def _read_metadata(checkpoint: str) -> Metadata:
    try:
        return dcp.FileSystemReader(checkpoint).read_metadata()
    except FileNotFoundError:
        raise CheckpointError(
            f"{checkpoint} is not a DCP checkpoint: it has no .metadata file (dcp.save writes it last, "
            "once every rank has written its part)"
        ) from None
    except Exception as exc:  # noqa: BLE001 - an unreadable pickle
        raise CheckpointCorruptError(
            f"DCP checkpoint {checkpoint}: its .metadata cannot be read ({type(exc).__name__}: {str(exc)[:300]})",
            path=checkpoint,
        ) from None


def _stage(
    engine: Any, layout: EngineLayout, targets: LoadTargets, groups: dict[str, object] | None, checkpoint: str
) -> Staged:
    """What the load changes, checked; ``groups``: the param groups' values
    read (None: the optimizer keeps its state)."""
    values = SlotValues(engine)
    staged = Staged(None, layout)
    try:
        for slot in layout.slots:
            if values.swapped and slot.piece is not None:
                continue  # trained ranges on NVMe: staged by stage_nvme, a sub-group at a time
            staged.slots.append((slot, targets.read(slot.name, slot.start, slot.stop)))
        if groups is not None:
            inner = engine.optimizer.inner
            staged.hyperparameters = loaded_hyperparameters(inner, layout, groups, checkpoint)
            staged.states = _states(inner, layout, targets, values, checkpoint)
        stage_nvme(engine, layout, targets, staged)
    except BaseException:
        staged.discard()
        raise
    return staged


def _states(
    inner: torch.optim.Optimizer, layout: EngineLayout, targets: LoadTargets, values: SlotValues, checkpoint: str
) -> dict[torch.nn.Parameter, dict]:
    kind = training_state.optimizer_kind(inner)
    groups = {id(p): g for g in inner.param_groups for p in g["params"]}
    states = {}
    for slot in layout.slots_of(TRAINED):
        step, keys = targets.step(slot.name), targets.state_keys[slot.name]
        if step is None and not keys:
            continue  # never stepped when saved
        state = {} if step is None else {"step": step.clone()}  # each piece steps its own counter
        for key in keys:  # the moments of states on NVMe are read in stage_nvme
            state[key] = torch.empty(0) if values.swapped else targets.read(slot.name, slot.start, slot.stop, key)
        try:
            live = values.state_template(slot)
            state = training_state.checked_piece_state(state, live, kind, groups[id(slot.piece)], values.moment_like(slot))
        except ValueError as exc:
            raise CheckpointMismatchError(
                f"DCP checkpoint {checkpoint}: optimizer state of {slot.name}: {exc}"
            ) from None
        states[slot.piece] = state
    return states
