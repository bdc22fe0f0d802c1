"""``engine.load_checkpoint``: from a checkpoint of any world size, stage or
offload setting into this engine.

Two phases, so that a failed load changes nothing: every rank first reads
and verifies all it needs into fresh tensors and typed records (its ranges of
every tensor, optimizer states, RNG, scalars, counters: zcore.checkpoint.schema),
each checked against the object it will go into; then the ranks agree that
all succeeded, and only then is the state replaced, by steps that cannot fail.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Protocol

import torch

from zcore import arguments
from zcore.comm import collectives as comm
from zcore.memory.aio import AioEngine
from zcore.checkpoint import directory, durable, matrix_states, partials, schema, training_state
from zcore.checkpoint.files import shown
from zcore.checkpoint.layout import TRAINED, EngineLayout, Slot, engine_layout, mismatch, tensor_infos, whole_model_layout
from zcore.checkpoint.recut_parts import RecutParts
from zcore.checkpoint.saved_ranges import SavedRanges
from zcore.checkpoint.slot_values import SlotValues
from zcore.errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError, ZcoreError
from zcore.optim import CompressedAdam
from zcore.progress import progress_bar
from zcore.memory.swap import SwapManager
from zcore.step.swapped_optimizer import SwappedMaster, resting_state, state_rows

log = logging.getLogger("zcore")


class RangeSource(Protocol):
    """Where staging reads element ranges of saved tensors: a checkpoint's
    SavedRanges, or zcore.checkpoint.pretrained's Hugging Face files."""

    def read(self, name: str, start: int, stop: int, state: Optional[str] = None) -> torch.Tensor: ...

    def state_keys(self, name: str) -> list[str]: ...


def read_meta(tag_dir: Path) -> schema.Meta:
    path = tag_dir / directory.META
    content = durable.read_json(path)
    if not isinstance(content, dict) or content.get("format") != directory.FORMAT:
        found = content.get("format") if isinstance(content, dict) else content
        raise CheckpointError(f"{tag_dir} is not a zcore checkpoint ({path} says format {shown(found)})", path=str(path))
    version = content.get("version")
    if type(version) is int and version > directory.VERSION:
        raise CheckpointError(
            f"checkpoint {tag_dir} has format version {version}, written by a newer zcore; this "
            f"zcore reads versions up to {directory.VERSION}: upgrade zcore to load it"
        )
    return schema.validated(schema.Meta, content, path)


def resolve(load_dir: str | Path, tag: Optional[str]) -> Optional[Path]:
    """The tag directory to load; None when no tag is given and none was saved."""
    root = Path(load_dir)
    if tag is None:
        tag = directory.read_latest(root)
        if tag is None:
            return None
    tag_dir = root / directory.check_tag(tag)
    if not os.path.lexists(tag_dir / directory.META):  # anything there is read (and refused) as meta.json
        raise CheckpointError(
            f"no complete checkpoint {tag_dir} (no {directory.META}); tags in {root}: "
            f"{directory.tags_in(root) or 'none'}"
        )
    return tag_dir


def read_indexes(tag_dir: Path, meta: schema.Meta) -> list[schema.RankIndex]:
    indexes = []
    for rank, expected in enumerate(meta.ranks):
        path = tag_dir / directory.rank_index(rank)
        index = schema.validated(schema.RankIndex, durable.read_json(path, expected), path)
        schema.check_index(index, rank, meta, path)
        indexes.append(index)
    return indexes


@dataclass
class Staged:
    """Everything a load changes, read and checked: committing it cannot fail."""

    # None: from elsewhere, without zcore's training state: weights (zcore.checkpoint.pretrained),
    # or weights and optimizer states (zcore.checkpoint.dcp: ``hyperparameters`` then, no loss scaler).
    meta: Optional[schema.Meta]
    layout: EngineLayout
    slots: list[tuple[Slot, torch.Tensor]] = field(default_factory=list)
    states: Optional[dict[torch.nn.Parameter, dict]] = None  # None: keep the optimizer's
    # A whole-matrix optimizer's states of the matrices this rank computes (zcore.checkpoint.matrix_states).
    whole_states: Optional[dict[int, dict[str, torch.Tensor]]] = None
    # States on NVMe, staged aside in new swap files (zcore.checkpoint.slot_values).
    optimizer_swap: Optional[SwapManager] = None  # every sub-group: master, exp_avg, exp_avg_sq
    parameter_swap: Optional[SwapManager] = None  # every ZeRO-3 shard on NVMe
    unit_shards: dict[int, torch.Tensor] = field(default_factory=dict)  # in-memory shards of NVMe masters
    scheduler: Optional[dict] = None  # None: keep the scheduler's
    counters: Optional[schema.Counters] = None  # None: keep the engine's
    rng: Optional[dict[str, Any]] = None
    client_state: Any = None
    hyperparameters: list[dict] = field(default_factory=list)  # meta None: per optimizer group, the values to set

    def discard(self) -> None:
        """Removes the swap files staged (the load did not happen)."""
        for swap in (self.optimizer_swap, self.parameter_swap):
            if swap is not None:
                swap.close()


@dataclass(frozen=True)
class _Options:
    optimizer: bool  # optimizer states, hyper-parameters, loss scaler
    scheduler: bool
    training: bool  # counters and RNG (all but load_module_only)


def load_checkpoint(
    engine: Any,
    load_dir: str | Path,
    tag: Optional[str] = None,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
) -> tuple[Optional[Path], Any]:
    """Returns (the tag directory loaded, the client_state saved with it), or
    (None, None) when ``tag`` is None and ``load_dir`` holds no ``latest``.

    Every rank prepares (finds the tag, reads and checks everything), then
    the ranks agree, even when a rank's preparation failed: a failure on one
    rank fails the load on every rank, naming it, before any state changes
    and before any rank can wait in another collective."""
    load_dir = arguments.directory(load_dir, "load_dir")
    options = _Options(
        # An engine without an optimizer (inference) takes the weights only, as DeepSpeed's does.
        optimizer=load_optimizer_states and not load_module_only and engine.optimizer is not None,
        scheduler=load_lr_scheduler_states and not load_module_only,
        training=not load_module_only,
    )
    directory.check_same_tag(tag, f"loading a checkpoint from {load_dir}")
    layout = engine_layout(engine)
    whole = whole_model_layout(engine, layout)  # collective: before anything that may fail on one rank
    tag_dir, staged, failure = None, None, None
    try:
        tag_dir = resolve(load_dir, tag)
        if tag_dir is not None:
            staged = _stage(engine, tag_dir, options, layout, whole)
    except BaseException as exc:  # noqa: BLE001 - every rank must learn of it
        failure = as_checkpoint_error(exc, f"loading checkpoint from {load_dir}")
    try:
        comm.raise_if_any_failed(failure, f"loading checkpoint from {load_dir}", CheckpointError)
        resolved = comm.all_gather_strings(None if tag_dir is None else str(tag_dir))
        if len(set(resolved)) > 1:
            raise CheckpointError(
                f"the ranks found different checkpoints in {load_dir}: {resolved}; every rank must see "
                "the same directory (a shared filesystem) and it must not change during the load"
            )
    except BaseException:
        if staged is not None:
            staged.discard()
        raise
    if engine.context.rank == 0:
        partials.remove_abandoned(Path(load_dir))
    if tag_dir is None:
        log.warning("zcore: no 'latest' file in %s: nothing loaded", load_dir)
        return None, None
    commit(engine, staged)
    log.info("zcore: loaded checkpoint %s (saved at world size %d)", tag_dir, staged.meta.world_size)
    return tag_dir, staged.client_state


def _stage(engine: Any, tag_dir: Path, options: _Options, layout: EngineLayout, whole: EngineLayout) -> Staged:
    """``whole``: ``layout`` with every pipeline stage's tensors, to check the model by."""
    meta = read_meta(tag_dir)
    _check_model(whole, meta, tag_dir)
    if options.optimizer:
        _check_optimizer(engine, whole, meta, tag_dir)
    indexes = read_indexes(tag_dir, meta)
    staged = Staged(meta, layout)
    try:
        _read(engine, tag_dir, options, meta, layout, indexes, staged)
    except BaseException:
        staged.discard()
        raise
    return staged


def _read(
    engine: Any, tag_dir: Path, options: _Options, meta: schema.Meta, layout: EngineLayout,
    indexes: list[schema.RankIndex], staged: Staged,
) -> None:
    rank = engine.context.rank
    values = SlotValues(engine)
    recut = RecutParts(tensor_infos(meta.tensors), layout.tensors)
    infos = recut.infos()
    total = _bytes_to_read(layout, infos, recut, indexes, options.optimizer)
    with (
        progress_bar(f"loading checkpoint {tag_dir.name}", total) as bar,
        SavedRanges(tag_dir, indexes, AioEngine(tag_dir), progress=bar) as ranges,
    ):
        saved = recut.reading(ranges)
        for slot in layout.slots:
            if values.swapped and infos[slot.name].role == TRAINED:
                found = saved.dtype(slot.name, slot.start, slot.stop)  # read in stage_nvme
            else:
                value = saved.read(slot.name, slot.start, slot.stop)
                found = value.dtype
                staged.slots.append((slot, value))
            if found != infos[slot.name].dtype:
                raise CheckpointCorruptError(
                    f"checkpoint {tag_dir} stores {slot.name} as {found}, its {directory.META} says "
                    f"{infos[slot.name].dtype}", path=str(tag_dir)
                )
        if options.optimizer:
            staged.states = {}
            inner = engine.optimizer.inner
            groups = {id(p): g for g in inner.param_groups for p in g["params"]}
            for slot in layout.slots_of(TRAINED):
                keys = saved.state_keys(slot.name)
                source = recut.source_name(slot.name)
                owner = next((ix for ix in indexes if source in ix.scalars), None)
                scalars = owner.scalars[source] if owner is not None else {}
                if not keys and not scalars:
                    continue  # never stepped when saved (an optimizer may keep scalars only)
                if values.swapped:  # ranged states are read in stage_nvme
                    state = {key: torch.empty(0, dtype=saved.dtype(slot.name, slot.start, slot.stop, key))
                             for key in keys}
                else:
                    state = {key: saved.read(slot.name, slot.start, slot.stop, key) for key in keys}
                path = tag_dir / directory.rank_index(owner.rank if owner is not None else 0)
                both = sorted(set(scalars) & set(state))
                if both:
                    raise schema.invalid(path, f"scalars.{slot.name}.{both[0]}", "is also a ranged state")
                state.update(training_state.join_scalars(scalars))
                try:
                    state = training_state.checked_piece_state(
                        state, values.state_template(slot), meta.optimizer.kind, groups[id(slot.piece)],
                        values.moment_like(slot),
                    )
                except ValueError as exc:
                    raise schema.invalid(path, f"optimizer state of {slot.name}", str(exc)) from None
                staged.states[slot.piece] = state
            staged.whole_states = matrix_states.staged_states(engine, layout, indexes, saved.read_whole)
        if options.training:
            staged.counters = meta.counters
            if rank < len(indexes):
                tensors = {k: saved.read_whole(rank, "state", k) for k in ("rng::torch", "rng::cuda")
                           if k in indexes[rank].files.state.tensors}
                try:
                    staged.rng = training_state.staged_rng(indexes[rank].rng, tensors, engine.context.device)
                except ValueError as exc:
                    raise schema.invalid(tag_dir / directory.rank_index(rank), "rng", str(exc)) from None
        client_keys = [k for k in indexes[0].files.state.tensors if k.startswith("client::")]
        client_tensors = {k: saved.read_whole(0, "state", k) for k in client_keys}
        meta_path = tag_dir / directory.META
        _check_state(engine, meta, meta_path, options, staged)
        try:
            staged.client_state = training_state.decode_client_state(meta.client_state, client_tensors)
        except ValueError as exc:
            raise schema.invalid(meta_path, "client_state", str(exc)) from None
        stage_nvme(engine, layout, saved, staged)


def _bytes_to_read(
    layout: EngineLayout, infos: dict, recut: RecutParts, indexes: list[schema.RankIndex], optimizer: bool
) -> int:
    """What ``_read`` reads for this rank's slots, for its progress bar: the
    range of each tensor and, with the optimizer's states, of each ranged
    state saved with it (in the tensor's dtype, as torch's optimizers keep them;
    a recut tensor's ranges as this engine cuts it)."""
    ranged = {(r.of, r.state) for index in indexes for r in index.ranges.values() if r.state is not None}
    states_of = Counter(name for name, _ in ranged)
    total = 0
    for slot in layout.slots:
        copies = 1 + (states_of[recut.source_name(slot.name)] if optimizer and layout.tensors[slot.name].role == TRAINED else 0)
        total += copies * (slot.stop - slot.start) * infos[slot.name].dtype.itemsize
    return total


def stage_nvme(engine: Any, layout: EngineLayout, saved: RangeSource, staged: Staged) -> None:
    """Values whose home is on NVMe go to new swap files, adopted at commit:
    optimizer sub-groups (with each unit's compute-dtype shard), and ZeRO-3
    shards resting on NVMe, trained and frozen."""
    optimizer, residency = engine.optimizer, engine.residency
    nvme_groups = {g.index for g in getattr(residency, "groups", []) if not g.in_memory}
    if nvme_groups:
        staged.parameter_swap = residency.new_parameter_swap()
    if optimizer is not None:
        _stage_trained_nvme(optimizer, layout, saved, staged)
    frozen: dict[int, torch.Tensor] = {}
    kept = []
    for slot, value in staged.slots:
        if slot.group is None or slot.group.index not in nvme_groups:
            kept.append((slot, value))
            continue
        shard = frozen.setdefault(slot.group.index, torch.zeros(slot.group.shard_numel, dtype=slot.group.dtype))
        shard[slot.shard_start : slot.shard_start + value.numel()].copy_(value)
    staged.slots = kept
    for group, shard in frozen.items():
        staged.parameter_swap.swap_out(group, shard)
        staged.parameter_swap.wait(group)


def _stage_trained_nvme(optimizer: Any, layout: EngineLayout, saved: RangeSource, staged: Staged) -> None:
    shards = optimizer.update.shards

    def put_shard(u: int, shard: torch.Tensor) -> None:
        unit = optimizer.units[u]
        if shards.resident(unit) is None:  # on NVMe: a ZeRO-3 group
            staged.parameter_swap.swap_out(unit.index, shard)
            staged.parameter_swap.wait(unit.index)
        else:
            staged.unit_shards[u] = shard

    master = optimizer.master
    if isinstance(master, SwappedMaster):
        staged.optimizer_swap = _stage_sub_groups(master, state_rows(optimizer.inner), layout, saved, staged, put_shard)
    elif staged.parameter_swap is not None:  # trained NVMe shards from the staged master values
        by_piece = {id(slot.piece): value for slot, value in staged.slots if slot.piece is not None}
        for u, (unit, pieces) in enumerate(zip(optimizer.units, master.pieces)):
            if shards.resident(unit) is None:
                shard = torch.zeros(unit.shard_numel, dtype=unit.dtype)
                for meta, piece in zip(unit.pieces, pieces):
                    shard[meta.shard_start : meta.shard_start + meta.numel].copy_(by_piece[id(piece)])
                put_shard(u, shard)


def _stage_sub_groups(
    master: SwappedMaster, rows: Any, layout: EngineLayout, saved: RangeSource, staged: Staged, put_shard: Any
) -> SwapManager:
    """Without optimizer states to load, each sub-group keeps its moments
    (``rows(piece)``: where a piece's ranged states rest)."""
    slots = {id(slot.piece): slot for slot in layout.slots_of(TRAINED)}
    states = staged.states

    def values(u: int, k: int, lo: int, hi: int) -> torch.Tensor:
        piece = master.pieces[u][k]
        slot = slots[id(piece)]
        out = torch.zeros(3, hi - lo, dtype=master.dtype)
        out[0] = saved.read(slot.name, slot.start + lo, slot.start + hi)
        if states is not None and piece in states:
            for key, row in rows(piece).items():
                if key in states[piece]:
                    out[row] = saved.read(slot.name, slot.start + lo, slot.start + hi, key)
        return out

    return master.stage(values, put_shard, keep_moments=states is None)


def _check_state(engine: Any, meta: schema.Meta, path: Path, options: _Options, staged: Staged) -> None:
    """The parts of meta.json that are applied to live objects, checked
    against those objects."""
    if options.optimizer:
        try:
            training_state.check_hyperparameters(engine.optimizer.inner, meta.optimizer.hyperparameters)
        except ValueError as exc:
            raise schema.invalid(path, "optimizer.hyperparameters", str(exc)) from None
    scheduler = engine.lr_scheduler
    if options.scheduler and scheduler is not None and meta.lr_scheduler is not None:
        if not hasattr(scheduler, "load_state_dict"):
            raise schema.invalid(path, "lr_scheduler", f"this engine's {type(scheduler).__name__} cannot load a state")
        try:
            training_state.check_scheduler(scheduler, meta.lr_scheduler)
        except ValueError as exc:
            raise schema.invalid(path, "lr_scheduler", str(exc)) from None
        staged.scheduler = meta.lr_scheduler


def _check_model(layout: EngineLayout, meta: dict, tag_dir: Path) -> None:
    saved = tensor_infos(meta.tensors)
    current = layout.tensors
    # The tp parts of a tensor both sides hold: cut another way, they recut (zcore.checkpoint.recut_parts).
    parts = {n for infos in (saved, current) for whole, info in infos.items()
             if info.parts is not None and whole in saved and whole in current for n in info.parts[1]}
    missing = [n for n in current if n not in saved and n not in parts]
    unexpected = [n for n in saved if n not in current and n not in parts]
    reshaped = [f"{n}: saved {list(saved[n].shape)}, model {list(current[n].shape)}"
                for n in current if n in saved and n not in parts and saved[n].shape != current[n].shape]
    if missing or unexpected or reshaped:
        raise CheckpointMismatchError(
            f"checkpoint {tag_dir} is of another model (as its {directory.META} describes it); tensors " + mismatch(missing, unexpected, reshaped)
            + ". Load it into the model it was saved from (or pass load_module_only with a matching model)",
            missing=missing, unexpected=unexpected, reshaped=reshaped,
        )


def _check_optimizer(engine: Any, layout: EngineLayout, meta: dict, tag_dir: Path) -> None:
    saved = meta.optimizer
    kind = training_state.optimizer_kind(engine.optimizer.inner)
    if saved.kind != kind:
        raise CheckpointMismatchError(
            f"checkpoint {tag_dir} holds {saved.kind} optimizer states (its {directory.META} says); this engine's optimizer is "
            f"{kind}. Use the same optimizer, or load with load_optimizer_states=False"
        )
    ours = [set(g) for g in layout.groups]
    theirs = [set(g) for g in saved.groups]
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
            f"checkpoint {tag_dir} has {len(theirs)} optimizer parameter groups (its {directory.META} says), this engine "
            f"{len(ours)}; they differ in {'; '.join(differences[:3])}. Build the optimizer with the "
            "same groups, or load with load_optimizer_states=False"
        )


def as_checkpoint_error(exc: BaseException, doing: str) -> BaseException:
    """``exc`` as a load raises it on every rank: zcore's errors (and what
    is not an Exception) as they are, any other as a CheckpointError naming
    what was being done."""
    if isinstance(exc, ZcoreError) or not isinstance(exc, Exception):
        return exc
    return CheckpointError(f"{doing} failed: {type(exc).__name__}: {str(exc)[:500]}")


def commit_when_all_staged(engine: Any, staged: Optional[Staged], failure: Optional[BaseException], doing: str) -> None:
    """Commits ``staged`` once every rank staged its part; where any rank's
    staging failed (``failure`` on this one), discards this rank's and
    raises on every rank. Collective."""
    try:
        comm.raise_if_any_failed(failure, doing, CheckpointError)
    except BaseException:
        if staged is not None:
            staged.discard()
        raise
    commit(engine, staged)


def commit(engine: Any, staged: Staged) -> None:
    """Replaces the engine's state with what was staged (and checked)."""
    engine.checkpoints.finish_copy()  # an asynchronous save may still be copying the values replaced here
    optimizer = engine.optimizer
    meta = staged.meta
    with torch.no_grad():
        for slot, value in staged.slots:
            slot.data.copy_(value)
        if optimizer is None:
            pass  # an inference engine: its parameters are all in staged.slots
        elif isinstance(optimizer.master, SwappedMaster):
            if staged.optimizer_swap is not None:
                optimizer.master.adopt(staged.optimizer_swap)
            for u, shard in staged.unit_shards.items():
                optimizer.update.shards.write(optimizer.units[u], shard)
        else:
            shards = optimizer.update.shards
            for unit, shard in zip(optimizer.units, optimizer.master.shards):
                if shards.resident(unit) is not None:  # NVMe shards were staged aside
                    shards.write(unit, shard)
    if staged.parameter_swap is not None:
        engine.residency.adopt_parameter_swap(staged.parameter_swap)
    engine.residency.reload()
    if staged.states is not None:
        inner = optimizer.inner
        rows = state_rows(inner)
        for slot in staged.layout.slots_of(TRAINED):
            state = staged.states.get(slot.piece)
            if state is None:
                inner.state.pop(slot.piece, None)
                continue
            if isinstance(optimizer.master, SwappedMaster):
                # the ranged states are in the sub-groups
                inner.state[slot.piece] = resting_state(state, rows(slot.piece), slot.data)
                continue
            inner.state[slot.piece] = {
                k: (v.to(slot.data.device) if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
                for k, v in state.items()
            }
        if staged.whole_states is not None:
            optimizer.update.matrix.load_whole_states(staged.whole_states)
        training_state.apply_hyperparameters(
            inner, meta.optimizer.hyperparameters if meta is not None else staged.hyperparameters
        )
        if isinstance(inner, CompressedAdam):  # error feedback and schedule start afresh, as in DeepSpeed
            inner.restart_from_loaded_state()
        if meta is not None:
            optimizer.precision.scaler.load_state_dict(meta.loss_scaler.as_dict())
    if staged.scheduler is not None:
        engine.lr_scheduler.load_state_dict(staged.scheduler)
    if staged.counters is not None:
        engine.restore_counters(staged.counters)
    if staged.rng is not None:
        training_state.set_rng_state(staged.rng, engine.context.device)
    if meta is not None and meta.world_size != engine.context.world_size and engine.context.rank == 0:
        log.info(
            "zcore: checkpoint saved at world size %d, loaded at %d: ranks below %d got their saved "
            "RNG states, the others keep theirs",
            meta.world_size, engine.context.world_size, meta.world_size,
        )
