"""``engine.save_checkpoint``: every rank writes its ranges in parallel.

Order of a save, each step durable before the next:
1. rank 0 creates the staging directory ``.TAG.partial``;
2. every rank writes its weights file, its state file, then its index
   (ranges and checksums of both), each through a temporary name;
3. once every rank succeeded, rank 0 writes ``meta.json`` (with the
   checksums of the indexes), renames the staging directory to TAG in one
   atomic step, then replaces ``latest``.
A save killed anywhere before the rename leaves the previous checkpoints
and ``latest`` as they were; a failure on any rank fails the save on all.
Its staging directory is removed by a later save or load
(zcore.checkpoint.partials says which ones and why).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

import torch

from zcore.comm import collectives as comm
from zcore.memory.aio import AioEngine
from zcore.checkpoint import directory, durable, partials, training_state
from zcore.checkpoint.layout import TRAINED, EngineLayout, describe, engine_layout, whole_model_layout
from zcore.checkpoint.slot_values import SlotValues
from zcore.checkpoint.tensor_file import TensorFileWriter, TensorSpec
from zcore.errors import CheckpointError, DiskIOError
from zcore.progress import progress_bar

log = logging.getLogger("zcore")


def save_checkpoint(engine: Any, save_dir: str | Path, tag: Optional[str] = None, client_state: Any = None) -> Path:
    """Writes ``engine``'s checkpoint under ``save_dir/tag`` (default
    ``global_step{N}``): each rank its ranges of the fp32 weights and
    optimizer states, beside JSON metadata, published atomically; then
    ``save_dir/latest`` names the tag. Collective, at an accumulation
    boundary. Returns the tag directory."""
    if engine.accumulated_micro_steps:
        raise CheckpointError(
            f"save_checkpoint was called after micro-step {engine.micro_steps}, inside a gradient "
            f"accumulation window ({engine.accumulated_micro_steps} micro-steps accumulated): the partial "
            "gradients would be lost; save right after the engine.step() that ends the window"
        )
    tag = tag if tag is not None else f"global_step{engine.global_steps}"
    directory.check_same_tag(tag, f"saving a checkpoint in {save_dir}")
    tag = directory.check_tag(tag)
    client, failure = None, None
    try:
        client = training_state.encode_client_state(client_state)
    except CheckpointError as exc:
        failure = exc
    # Every rank learns of one rank's refusal (its collectives below would wait alone).
    comm.raise_if_any_failed(failure, "saving the checkpoint's client_state", CheckpointError)
    layout = engine_layout(engine)
    whole = whole_model_layout(engine, layout)  # before the directory: a refusal leaves nothing
    root = Path(save_dir)
    rank = engine.context.rank
    staging = directory.staging_dir(root, tag)
    if rank == 0:
        try:
            durable.make_dir(root, parents=True, exist_ok=True)
            directory.check_tag_free(root, tag)
            partials.start(staging)
        except (CheckpointError, DiskIOError) as exc:
            failure = exc
        except OSError as exc:
            failure = durable.io_error(exc, staging, "creating the checkpoint directory")
    comm.raise_if_any_failed(failure, "creating the checkpoint directory", CheckpointError)

    index_checksum = None
    try:
        index_checksum = _write_rank(engine, layout, staging, tag, client[1])
    except BaseException as exc:  # noqa: BLE001 - every rank must learn of it
        failure = exc
    checksums = comm.all_gather_strings(index_checksum)
    _agree(failure, "writing the checkpoint", rank, staging)

    if rank == 0:
        try:
            durable.write_json(staging / directory.META, _meta(engine, whole, tag, checksums, client[0]))
            durable.replace_dir(staging, root / tag)
            durable.write_bytes(root / directory.LATEST, tag.encode())
        except BaseException as exc:  # noqa: BLE001
            failure = exc
    _agree(failure, "committing the checkpoint", rank, staging)
    log.info("zcore: saved checkpoint %s", root / tag)
    return root / tag


def _agree(failure: Optional[BaseException], doing: str, rank: int, staging: Path) -> None:
    try:
        comm.raise_if_any_failed(failure, doing, CheckpointError)
    except BaseException:
        if rank == 0:
            durable.remove_tree(staging)
        raise


def _write_rank(
    engine: Any, layout: EngineLayout, staging: Path, tag: str, client_tensors: dict[str, torch.Tensor]
) -> str:
    """The weights and state files of this rank, then its index. Both files
    are written in one pass over the values, so that states on NVMe are read
    once, a sub-group at a time (zcore.checkpoint.slot_values)."""
    rank = engine.context.rank
    values = SlotValues(engine)
    saved = [s for s in layout.slots if s.saves]
    trained = layout.slots_of(TRAINED)
    ranges = {s.name: {"file": "weights", "of": s.name, "start": s.start, "stop": s.stop} for s in saved}
    state_specs: list[TensorSpec] = []
    scalars: dict[str, dict] = {}
    for slot in trained:
        template = values.state_template(slot) if slot.saves else None
        if template is None:
            continue
        ranged, scalar = training_state.split_state(template, slot.data.numel(), slot.name)
        for key, value in ranged.items():
            state_specs.append(TensorSpec(f"{slot.name}::{key}", value.dtype, (slot.data.numel(),)))
            ranges[f"{slot.name}::{key}"] = {"file": "state", "of": slot.name, "state": key,
                                             "start": slot.start, "stop": slot.stop}
        scalars[slot.name] = scalar
    rng, extra = training_state.rng_state(engine.context.device)
    if rank == 0:
        extra.update(client_tensors)
    state_specs += [TensorSpec(k, v.dtype, tuple(v.shape)) for k, v in extra.items()]

    io = AioEngine(staging)  # O_DIRECT writes: zcore.checkpoint.direct_file
    weight_specs = [TensorSpec(s.name, s.data.dtype, (s.data.numel(),)) for s in saved]
    total = sum(spec.nbytes for spec in weight_specs + state_specs)
    with (
        TensorFileWriter(staging / directory.weights_file(rank), weight_specs, engine=io) as weights_out,
        TensorFileWriter(staging / directory.state_file(rank), state_specs, engine=io) as state_out,
        progress_bar(f"saving checkpoint {tag}", total) as bar,
    ):
        for slot, data, state in values.trained(trained):  # first in the layout, so first in both files
            if not slot.saves:
                continue
            weights_out.write(data)
            bar.update(data.nbytes)
            if slot.name in scalars:
                ranged, _ = training_state.split_state(state, slot.data.numel(), slot.name)
                for value in ranged.values():
                    state_out.write(value)
                    bar.update(value.nbytes)
        for slot in saved:
            if layout.tensors[slot.name].role != TRAINED:
                frozen = values.frozen(slot)
                weights_out.write(frozen)
                bar.update(frozen.nbytes)
        for value in extra.values():
            state_out.write(value)
            bar.update(value.nbytes)
        weights = weights_out.commit()
        state = state_out.commit()

    index = {
        "rank": rank,
        "files": {"weights": weights.to_json(), "state": state.to_json()},
        "ranges": ranges,
        "scalars": scalars,
        "rng": rng,
    }
    return durable.write_json(staging / directory.rank_index(rank), index)


def _meta(engine: Any, layout: EngineLayout, tag: str, checksums: list, client_json: Any) -> dict:
    optimizer = engine.optimizer
    offload = engine.policies.offload.optimizer.value
    return {
        "format": directory.FORMAT,
        "version": directory.VERSION,
        "tag": tag,
        "world_size": engine.context.world_size,
        "zero_stage": engine.zero_stage,
        "offload_optimizer": offload,
        "compute_dtype": str(optimizer.precision.compute_dtype).removeprefix("torch."),
        "config": engine.config.model_dump(mode="json"),
        "counters": {
            "global_steps": engine.global_steps,
            "global_samples": engine.global_samples,
            "micro_steps": engine.micro_steps,
            "skipped_steps": engine.skipped_steps,
        },
        "tensors": describe(layout.tensors),
        "keys": layout.keys,
        "optimizer": {
            "kind": training_state.optimizer_kind(optimizer.inner),
            "groups": layout.groups,
            "hyperparameters": training_state.hyperparameters(optimizer.inner),
        },
        "loss_scaler": optimizer.precision.scaler.state_dict(),
        "lr_scheduler": training_state.scheduler_state(engine.lr_scheduler),
        "client_state": client_json,
        "ranks": checksums,
    }
