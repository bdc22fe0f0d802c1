"""DeepSpeed's checkpoint as zcore's: the records a zcore checkpoint's
``meta.json`` holds, made from a DeepSpeed checkpoint
(zcore.checkpoint.deepspeed_files), and ``load_deepspeed_checkpoint``,
which loads one into an engine of any stage and world size.

The load is zcore.checkpoint.load's, with DeepSpeed's files as the source:
every rank reads DeepSpeed's rank files one at a time, keeping only the
element ranges its own shards hold (fp32 weights, Adam's moments), checks
them against the engine, and the engine's state is replaced only once every
rank succeeded. As DeepSpeed's own load, it restores the weights, the
optimizer's states and hyper-parameters, the loss scaler, the scheduler and
the step counters, and leaves the RNG as it is (DeepSpeed saves none).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional

import torch

from zcore.checkpoint import directory, schema, training_state
from zcore.checkpoint.deepspeed_files import MOMENTS, DeepSpeedCheckpoint, loss_scaler_state, open_checkpoint, read_rank
from zcore.checkpoint.full_state import refuse_model_parallel
from zcore.checkpoint.layout import BUFFER, FROZEN, TRAINED, EngineLayout, TensorInfo, describe, engine_layout
from zcore.checkpoint.load import Staged, as_checkpoint_error, commit_when_all_staged, stage_nvme
from zcore.checkpoint.slot_values import SlotValues
from zcore.errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError

log = logging.getLogger("zcore")

# The update's hyper-parameters DeepSpeed's optimizer state carries over (the
# optimizer's implementation flags, foreach or fused, stay the engine's).
_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")
_NO_RANK_INDEXES = "0" * 16  # meta.ranks of a checkpoint read from DeepSpeed's files, which have none


def tensors_of(checkpoint: DeepSpeedCheckpoint) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint, as zcore describes it: trained ones in fp32."""
    tensors = {name: TensorInfo(shape, torch.float32, TRAINED) for group in checkpoint.groups for name, shape in group.items()}
    for name, value in checkpoint.module.items():
        role = BUFFER if name in checkpoint.buffer_names else FROZEN
        tensors[name] = TensorInfo(tuple(value.shape), value.dtype, role)
    return tensors


def meta_of(checkpoint: DeepSpeedCheckpoint, hyperparameters: list[dict], ranks: list[str], client_state: Any) -> dict:
    """The ``meta.json`` of the checkpoint as zcore's (zcore.checkpoint.schema.Meta)."""
    config = checkpoint.config
    offload = ((config.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("device", "none")
    gas = config.get("gradient_accumulation_steps") or 1
    counters = checkpoint.counters
    try:
        config_json = json.loads(json.dumps(config))
    except (TypeError, ValueError):
        config_json = {}
    return {
        "format": directory.FORMAT,
        "version": directory.VERSION,
        "tag": checkpoint.tag_dir.name,
        "world_size": checkpoint.world_size,
        "zero_stage": checkpoint.stage,
        "offload_optimizer": offload if offload in ("cpu", "nvme") else "none",
        "compute_dtype": checkpoint.compute_dtype,
        "config": config_json,
        # DeepSpeed keeps no micro-step count: every optimizer step took gas of them.
        "counters": dict(counters, micro_steps=counters["global_steps"] * gas),
        "tensors": describe(tensors_of(checkpoint)),
        "keys": {**{n: n for n in tensors_of(checkpoint)}, **checkpoint.aliases},
        "optimizer": {
            "kind": checkpoint.optimizer_kind() or "Adam",
            "groups": [list(group) for group in checkpoint.groups],
            "hyperparameters": hyperparameters,
        },
        "loss_scaler": loss_scaler_state(checkpoint),
        "lr_scheduler": checkpoint.lr_scheduler,
        "client_state": client_state,
        "ranks": ranks,
    }


def hyperparameters_of(param_groups: list[dict]) -> list[dict]:
    """DeepSpeed's optimizer groups' hyper-parameters, as JSON."""
    return [
        {k: (list(g[k]) if isinstance(g[k], tuple) else g[k]) for k in _HYPERPARAMETERS if k in g} for g in param_groups
    ]


def check_model(checkpoint: DeepSpeedCheckpoint, layout: EngineLayout) -> None:
    """The engine's model has the checkpoint's tensors, of the same shapes."""
    if any(info.parts is not None for info in layout.tensors.values()):
        raise CheckpointError("loading a DeepSpeed checkpoint into a tensor-parallel engine is not supported")
    saved = tensors_of(checkpoint)
    current = layout.tensors
    missing = [n for n in current if n not in saved]
    unexpected = [n for n in saved if n not in current]
    reshaped = [f"{n}: checkpoint {list(saved[n].shape)}, model {list(current[n].shape)}"
                for n in current if n in saved and saved[n].shape != current[n].shape]
    trained = [n for n in current if n in saved and (saved[n].role == TRAINED) != (current[n].role == TRAINED)]
    if missing or unexpected or reshaped or trained:
        parts = []
        for label, names in (("missing from the checkpoint", missing),
                             ("in the checkpoint but not in the model", unexpected),
                             ("with another shape", reshaped),
                             ("trained on one side and frozen on the other", trained)):
            if names:
                parts.append(f"{label}: {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}")
        raise CheckpointMismatchError(
            f"DeepSpeed checkpoint {checkpoint.tag_dir} is of another model; parameters " + "; ".join(parts)
            + ". Build the model the checkpoint was saved from",
            missing=missing, unexpected=unexpected, reshaped=reshaped,
        )
    ours = [set(g) for g in layout.groups]
    theirs = [set(g) for g in checkpoint.groups]
    if ours != theirs:
        raise CheckpointMismatchError(
            f"DeepSpeed checkpoint {checkpoint.tag_dir} has {len(theirs)} optimizer parameter groups "
            f"({[sorted(g)[:3] for g in theirs]}), this engine {len(ours)} ({[sorted(g)[:3] for g in ours]}); "
            "build the optimizer with the same parameter groups"
        )


class RankRanges:
    """This rank's element ranges of the checkpoint's tensors (fp32 weights
    and Adam's moments of trained ones, values of frozen ones and buffers),
    cut from DeepSpeed's rank files read one at a time; what
    zcore.checkpoint.load's staging reads (its RangeSource)."""

    def __init__(self, checkpoint: DeepSpeedCheckpoint, wanted: list[tuple[str, int, int]]) -> None:
        self._values: dict[str, list[tuple[int, dict[Optional[str], torch.Tensor]]]] = {}
        self.steps: dict[str, float] = {}  # trained tensor -> Adam's step
        self.param_groups: list[dict] = []  # rank 0's optimizer groups
        trained = {n: g for g, group in enumerate(checkpoint.groups) for n in group}
        filled: dict[tuple[str, int], int] = {}
        for name, start, stop in wanted:
            if name in trained:
                value = {key: torch.zeros(stop - start) for key in (None, *MOMENTS)}
                filled[(name, start)] = 0
            else:
                value = {None: checkpoint.module[name].reshape(-1)[start:stop].clone()}
            self._values.setdefault(name, []).append((start, value))
        for rank in range(checkpoint.world_size):
            state = read_rank(checkpoint, rank)
            if rank == 0:
                self.param_groups = state.param_groups
            for g, flat in enumerate(state.flats):
                for piece in checkpoint.pieces(rank, g, flat.numel()):
                    if state.steps[g] is not None:
                        self.steps[piece.name] = state.steps[g]
                    for start, value in self._values.get(piece.name, []):
                        lo = max(start, piece.start)
                        hi = min(start + value[None].numel(), piece.stop)
                        if lo >= hi:
                            continue
                        source = slice(piece.offset + lo - piece.start, piece.offset + hi - piece.start)
                        value[None][lo - start : hi - start].copy_(flat[source])
                        for key in MOMENTS:
                            if key in state.moments[g]:
                                value[key][lo - start : hi - start].copy_(state.moments[g][key][source])
                        filled[(piece.name, start)] += hi - lo
            del state  # before the next rank's file
        for name, start, stop in wanted:
            if name in trained and filled[(name, start)] != stop - start:
                raise CheckpointCorruptError(
                    f"DeepSpeed checkpoint {checkpoint.tag_dir}: its partitions hold {filled[(name, start)]} of "
                    f"the {stop - start} elements {name}[{start}:{stop}]; the optimizer files do not fit its "
                    "param_shapes", path=str(checkpoint.tag_dir),
                )

    def read(self, name: str, start: int, stop: int, state: Optional[str] = None) -> torch.Tensor:
        for first, value in self._values.get(name, []):
            if first <= start and stop <= first + value[None].numel():
                return value[state][start - first : stop - first]
        raise KeyError(f"{name}[{start}:{stop}] was not read")

    def state_keys(self, name: str) -> list[str]:
        return list(MOMENTS) if name in self.steps else []


def load_deepspeed_checkpoint(engine: Any, load_dir: str | Path, tag: Optional[str] = None) -> tuple[Path, Any]:
    """Loads a checkpoint DeepSpeed 0.19.8 saved (ZeRO stage 1, 2 or 3, any
    precision and world size) into ``engine``, of any stage and world
    size; call it on every rank. ``tag``: default, the one ``latest`` names.
    Returns (the tag directory, the client_state saved with it), as
    ``engine.load_checkpoint`` does. Training then goes on as DeepSpeed's
    would after its ``load_checkpoint``."""
    engine.lifetime.check_usable()
    refuse_model_parallel(engine, "zcore.load_deepspeed_checkpoint")
    engine._finish_step()
    layout = engine_layout(engine)
    staged, failure, checkpoint = None, None, None
    try:
        checkpoint = open_checkpoint(load_dir, tag)
        check_model(checkpoint, layout)
        staged = _stage(engine, checkpoint, layout)
    except BaseException as exc:  # noqa: BLE001 - every rank must learn of it
        failure = as_checkpoint_error(exc, f"loading DeepSpeed checkpoint from {load_dir}")
    commit_when_all_staged(engine, staged, failure, f"loading DeepSpeed checkpoint from {load_dir}")
    log.info("zcore: loaded DeepSpeed checkpoint %s (ZeRO stage %d, saved at world size %d)",
             checkpoint.tag_dir, checkpoint.stage, checkpoint.world_size)
    return checkpoint.tag_dir, checkpoint.client_state


def _stage(engine: Any, checkpoint: DeepSpeedCheckpoint, layout: EngineLayout) -> Staged:
    values = SlotValues(engine)
    ranges = RankRanges(checkpoint, [(s.name, s.start, s.stop) for s in layout.slots])
    path = checkpoint.tag_dir
    content = meta_of(checkpoint, hyperparameters_of(ranges.param_groups), [_NO_RANK_INDEXES] * checkpoint.world_size, None)
    meta = schema.validated(schema.Meta, content, path)
    staged = Staged(meta, layout)
    try:
        for slot in layout.slots:
            if values.swapped and slot.piece is not None:
                continue  # trained ranges on NVMe: staged by stage_nvme, a sub-group at a time
            staged.slots.append((slot, ranges.read(slot.name, slot.start, slot.stop).to(slot.data.dtype)))
        optimizer = engine.optimizer
        if optimizer is not None:
            _stage_optimizer(engine, checkpoint, layout, ranges, meta, values, staged)
        # A new accumulation window starts, as in DeepSpeed's resumed engine: the
        # micro-steps are counted in this engine's windows, not the saving one's.
        gas = engine.batch.gradient_accumulation_steps
        staged.counters = meta.counters.model_copy(update={"micro_steps": meta.counters.global_steps * gas})
        stage_nvme(engine, layout, ranges, staged)
    except BaseException:
        staged.discard()
        raise
    return staged


def _stage_optimizer(
    engine: Any, checkpoint: DeepSpeedCheckpoint, layout: EngineLayout, ranges: RankRanges,
    meta: schema.Meta, values: SlotValues, staged: Staged,
) -> None:
    inner = engine.optimizer.inner
    path = checkpoint.tag_dir
    kind = training_state.optimizer_kind(inner)
    saved_kind = checkpoint.optimizer_kind()
    if saved_kind is not None and saved_kind != kind:
        raise CheckpointMismatchError(
            f"DeepSpeed checkpoint {path} holds {saved_kind} optimizer states (its ds_config says); this "
            f"engine's optimizer is {kind}. Configure the same optimizer"
        )
    groups = {id(p): g for g in inner.param_groups for p in g["params"]}
    staged.states = {}
    for slot in layout.slots_of(TRAINED):
        if slot.name not in ranges.steps:
            continue  # never stepped when saved
        step = torch.tensor(ranges.steps[slot.name], dtype=torch.float32)
        if values.swapped:  # the moments are read in stage_nvme
            state = {"step": step, **{key: torch.empty(0) for key in MOMENTS}}
        else:
            state = {"step": step, **{key: ranges.read(slot.name, slot.start, slot.stop, key) for key in MOMENTS}}
        try:
            state = training_state.checked_piece_state(
                state, values.state_template(slot), kind, groups[id(slot.piece)], values.moment_like(slot)
            )
        except ValueError as exc:
            raise CheckpointMismatchError(f"DeepSpeed checkpoint {path}: optimizer state of {slot.name}: {exc}") from None
        staged.states[slot.piece] = state
    try:
        training_state.check_hyperparameters(inner, meta.optimizer.hyperparameters)
    except ValueError as exc:
        raise CheckpointMismatchError(f"DeepSpeed checkpoint {path}: optimizer hyper-parameters: {exc}") from None
    scheduler = engine.lr_scheduler
    if scheduler is not None and meta.lr_scheduler is not None:
        if not hasattr(scheduler, "load_state_dict"):
            raise CheckpointMismatchError(f"this engine's {type(scheduler).__name__} cannot load DeepSpeed's scheduler state")
        try:
            training_state.check_scheduler(scheduler, meta.lr_scheduler)
        except ValueError as exc:
            raise CheckpointMismatchError(f"DeepSpeed checkpoint {path}: lr_scheduler: {exc}") from None
        staged.scheduler = meta.lr_scheduler

