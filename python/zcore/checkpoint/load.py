"""``engine.load_checkpoint``: from a checkpoint of any world size, stage or
offload setting into this engine.

Two phases, so that a failed load changes nothing: every rank first reads
and verifies all it needs into fresh tensors (its ranges of every tensor,
optimizer states, RNG, scalars); then the ranks agree that all succeeded,
and only then is the state replaced.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from zcore import comm
from zcore.aio import AioEngine
from zcore.checkpoint import directory, durable, training_state
from zcore.checkpoint.layout import TRAINED, EngineLayout, Slot, engine_layout, tensor_infos
from zcore.checkpoint.saved_ranges import SavedRanges
from zcore.errors import CheckpointError, CheckpointMismatchError
from zcore.param_fetcher import ParamFetcher

log = logging.getLogger("zcore")


def read_meta(tag_dir: Path) -> dict:
    meta = durable.read_json(tag_dir / directory.META)
    if meta.get("format") != directory.FORMAT:
        raise CheckpointError(f"{tag_dir} is not a zcore checkpoint (format {meta.get('format')!r})")
    if meta.get("version", 0) > directory.VERSION:
        raise CheckpointError(
            f"checkpoint {tag_dir} has format version {meta['version']}, written by a newer zcore; this "
            f"zcore reads versions up to {directory.VERSION}: upgrade zcore to load it"
        )
    return meta


def resolve(load_dir: str | Path, tag: Optional[str]) -> Optional[Path]:
    """The tag directory to load; None when no tag is given and none was saved."""
    root = Path(load_dir)
    if tag is None:
        tag = directory.read_latest(root)
        if tag is None:
            return None
    tag_dir = root / directory.check_name(tag, "tag")
    if not (tag_dir / directory.META).is_file():
        raise CheckpointError(
            f"no complete checkpoint {tag_dir} (no {directory.META}); tags in {root}: "
            f"{directory.tags_in(root) or 'none'}"
        )
    return tag_dir


def read_indexes(tag_dir: Path, meta: dict) -> list[dict]:
    return [
        durable.read_json(tag_dir / directory.rank_index(rank), expected)
        for rank, expected in enumerate(meta["ranks"])
    ]


@dataclass
class _Staged:
    slots: list[tuple[Slot, torch.Tensor]] = field(default_factory=list)
    states: Optional[dict[torch.nn.Parameter, dict]] = None  # None: keep the optimizer's
    rng: Optional[tuple[dict, dict[str, torch.Tensor]]] = None
    client_state: Any = None


def load_checkpoint(
    engine: Any,
    load_dir: str | Path,
    tag: Optional[str] = None,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
) -> tuple[Optional[Path], Any]:
    """Returns (the tag directory loaded, the client_state saved with it), or
    (None, None) when ``tag`` is None and ``load_dir`` holds no ``latest``."""
    tag_dir = resolve(load_dir, tag)
    if tag_dir is None:
        log.warning("zcore: no 'latest' file in %s: nothing loaded", load_dir)
        return None, None
    layout = engine_layout(engine)
    staged, meta, failure = None, None, None
    try:
        meta = read_meta(tag_dir)
        with_optimizer = load_optimizer_states and not load_module_only
        staged = _stage(engine, layout, tag_dir, meta, with_optimizer)
    except BaseException as exc:  # noqa: BLE001 - every rank must learn of it
        failure = exc
    comm.raise_if_any_failed(failure, f"loading checkpoint {tag_dir}", CheckpointError)
    _commit(engine, layout, meta, staged, load_module_only, load_lr_scheduler_states)
    log.info("zcore: loaded checkpoint %s (saved at world size %d)", tag_dir, meta["world_size"])
    return tag_dir, staged.client_state


def _stage(engine: Any, layout: EngineLayout, tag_dir: Path, meta: dict, with_optimizer: bool) -> _Staged:
    _check_model(layout, meta, tag_dir)
    if with_optimizer:
        _check_optimizer(engine, layout, meta, tag_dir)
    indexes = read_indexes(tag_dir, meta)
    staged = _Staged()
    rank = engine.context.rank
    with SavedRanges(tag_dir, indexes, AioEngine(tag_dir)) as saved:
        for slot in layout.slots:
            staged.slots.append((slot, saved.read(slot.name, slot.start, slot.stop)))
        if with_optimizer:
            staged.states = {}
            for slot in layout.slots_of(TRAINED):
                keys = saved.state_keys(slot.name)
                if not keys:
                    continue  # never stepped when saved
                state = {key: saved.read(slot.name, slot.start, slot.stop, key) for key in keys}
                scalars = next(ix["scalars"][slot.name] for ix in indexes if slot.name in ix["scalars"])
                state.update(training_state.join_scalars(scalars))
                staged.states[slot.piece] = state
        if rank < len(indexes):
            rng = indexes[rank]["rng"]
            tensors = {k: saved.read_whole(rank, "state", k) for k in ("rng::torch", "rng::cuda")
                       if k in indexes[rank]["files"]["state"]["tensors"]}
            staged.rng = (rng, tensors)
        client_keys = [k for k in indexes[0]["files"]["state"]["tensors"] if k.startswith("client::")]
        client_tensors = {k: saved.read_whole(0, "state", k) for k in client_keys}
        staged.client_state = training_state.decode_client_state(meta["client_state"], client_tensors)
    return staged


def _check_model(layout: EngineLayout, meta: dict, tag_dir: Path) -> None:
    saved = tensor_infos(meta["tensors"])
    current = layout.tensors
    missing = [n for n in current if n not in saved]
    unexpected = [n for n in saved if n not in current]
    reshaped = [f"{n}: saved {list(saved[n].shape)}, model {list(current[n].shape)}"
                for n in current if n in saved and saved[n].shape != current[n].shape]
    if missing or unexpected or reshaped:
        parts = []
        for label, names in (("missing from the checkpoint", missing),
                             ("in the checkpoint but not in the model", unexpected),
                             ("with another shape", reshaped)):
            if names:
                parts.append(f"{label}: {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}")
        raise CheckpointMismatchError(
            f"checkpoint {tag_dir} is of another model; tensors " + "; ".join(parts)
            + ". Load it into the model it was saved from (or pass load_module_only with a matching model)",
            missing=missing, unexpected=unexpected, reshaped=reshaped,
        )


def _check_optimizer(engine: Any, layout: EngineLayout, meta: dict, tag_dir: Path) -> None:
    saved = meta["optimizer"]
    kind = training_state.optimizer_kind(engine.optimizer.inner)
    if saved["kind"] != kind:
        raise CheckpointMismatchError(
            f"checkpoint {tag_dir} holds {saved['kind']} optimizer states; this engine's optimizer is "
            f"{kind}. Use the same optimizer, or load with load_optimizer_states=False"
        )
    ours = [set(g) for g in layout.groups]
    theirs = [set(g) for g in saved["groups"]]
    if ours != theirs:
        differences = []
        for i in range(max(len(ours), len(theirs))):
            mine = ours[i] if i < len(ours) else set()
            its = theirs[i] if i < len(theirs) else set()
            if mine != its:
                differences.append(
                    f"group {i}: only in the checkpoint {sorted(its - mine)[:5]}, "
                    f"only in the engine {sorted(mine - its)[:5]}"
                )
        raise CheckpointMismatchError(
            f"checkpoint {tag_dir} has {len(theirs)} optimizer parameter groups, this engine "
            f"{len(ours)}; they differ in {'; '.join(differences[:3])}. Build the optimizer with the "
            "same groups, or load with load_optimizer_states=False"
        )


def _commit(
    engine: Any, layout: EngineLayout, meta: dict, staged: _Staged, module_only: bool, scheduler_states: bool
) -> None:
    optimizer = engine.optimizer
    with torch.no_grad():
        for slot, value in staged.slots:
            slot.data.copy_(value)
        for unit, shard in zip(optimizer.units, optimizer.master.shards):
            unit.local_shard.copy_(shard)
    residency = engine.residency
    if isinstance(residency, ParamFetcher):
        residency.reload()
    else:
        optimizer.publisher.publish()
    if staged.states is not None:
        inner = optimizer.inner
        for slot in layout.slots_of(TRAINED):
            state = staged.states.get(slot.piece)
            if state is None:
                inner.state.pop(slot.piece, None)
                continue
            inner.state[slot.piece] = {
                k: (v.to(slot.data.device) if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
                for k, v in state.items()
            }
        training_state.apply_hyperparameters(inner, meta["optimizer"]["hyperparameters"])
        optimizer.precision.scaler.load_state_dict(meta["loss_scaler"])
    if module_only:
        return
    if scheduler_states and engine.lr_scheduler is not None and meta["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    for key, value in meta["counters"].items():
        setattr(engine, key, value)
    if staged.rng is not None:
        training_state.set_rng_state(*staged.rng, engine.context.device)
    if meta["world_size"] != engine.context.world_size and engine.context.rank == 0:
        log.info(
            "zcore: checkpoint saved at world size %d, loaded at %d: ranks below %d got their saved "
            "RNG states, the others keep theirs",
            meta["world_size"], engine.context.world_size, meta["world_size"],
        )
