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

A save is prepared (``prepare_save``: the checks, the layout, what this
rank writes, the metadata, all as of now) on the training's process group,
then written (``write_save``: steps 1-3) over a group given: the training's
for a synchronous save, a dedicated one for the background writer of an
asynchronous save (zcore.checkpoint.async_save), whose collectives must not
interleave with the training's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

from zcore.comm import collectives as comm
from zcore import arguments
from zcore.checkpoint import directory, durable, partials, training_state
from zcore.checkpoint.layout import EngineLayout, describe, engine_layout, whole_model_layout
from zcore.checkpoint.rank_payload import RankPayload, rank_payload, write_payload
from zcore.errors import CheckpointError, DiskIOError

log = logging.getLogger("zcore")


@dataclass(frozen=True)
class SaveJob:
    """A prepared save: everything ``write_save`` needs, taken from the engine."""

    root: Path
    tag: str
    rank: int
    payload: RankPayload
    meta: Optional[dict]  # rank 0's meta.json without the indexes' checksums; None on other ranks


def save_checkpoint(engine: Any, save_dir: str | Path, tag: Optional[str] = None, client_state: Any = None) -> Path:
    """Writes ``engine``'s checkpoint under ``save_dir/tag`` (default
    ``global_step{N}``): each rank its ranges of the fp32 weights and
    optimizer states, beside JSON metadata, published atomically; then
    ``save_dir/latest`` names the tag. Collective, at an accumulation
    boundary. Returns the tag directory."""
    return write_save(prepare_save(engine, save_dir, tag, client_state))


def prepare_save(engine: Any, save_dir: str | Path, tag: Optional[str] = None, client_state: Any = None) -> SaveJob:
    """The checks of a save and what it will write, streaming from the
    engine's live state. Collective over the training's group; writes nothing."""
    save_dir = arguments.directory(save_dir, "save_dir")
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
    rank = engine.context.rank
    payload = None
    try:
        payload = rank_payload(engine, layout, client[1])
    except CheckpointError as exc:  # an optimizer state a checkpoint cannot hold
        failure = exc
    comm.raise_if_any_failed(failure, "preparing the checkpoint", CheckpointError)
    meta = _meta(engine, whole, tag, client[0]) if rank == 0 else None
    return SaveJob(Path(save_dir), tag, rank, payload, meta)


def write_save(job: SaveJob, group: Optional[dist.ProcessGroup] = None, show_progress: bool = True) -> Path:
    """Writes and publishes ``job``; collective over ``group`` (None: the
    world). ``show_progress``: whether rank 0 may draw a progress bar."""
    root, tag, rank = job.root, job.tag, job.rank
    staging = directory.staging_dir(root, tag)
    failure: Optional[BaseException] = None
    if rank == 0:
        try:
            durable.make_dir(root, parents=True, exist_ok=True)
            directory.check_tag_free(root, tag)
            partials.start(staging)
        except (CheckpointError, DiskIOError) as exc:
            failure = exc
        except OSError as exc:
            failure = durable.io_error(exc, staging, "creating the checkpoint directory")
    comm.raise_if_any_failed(failure, "creating the checkpoint directory", CheckpointError, group)

    index_checksum = None
    try:
        index_checksum = write_payload(job.payload, staging, tag, show_progress)
    except BaseException as exc:  # noqa: BLE001 - every rank must learn of it
        failure = exc
    checksums = comm.all_gather_strings(index_checksum, group)
    _agree(failure, "writing the checkpoint", rank, staging, group)

    if rank == 0:
        try:
            durable.write_json(staging / directory.META, {**job.meta, "ranks": checksums})
            durable.replace_dir(staging, root / tag)
            durable.write_bytes(root / directory.LATEST, tag.encode())
        except BaseException as exc:  # noqa: BLE001
            failure = exc
    _agree(failure, "committing the checkpoint", rank, staging, group)
    log.info("zcore: saved checkpoint %s", root / tag)
    return root / tag


def _agree(
    failure: Optional[BaseException], doing: str, rank: int, staging: Path, group: Optional[dist.ProcessGroup]
) -> None:
    try:
        comm.raise_if_any_failed(failure, doing, CheckpointError, group)
    except BaseException:
        if rank == 0:
            durable.remove_tree(staging)
        raise


def _meta(engine: Any, layout: EngineLayout, tag: str, client_json: Any) -> dict:
    """meta.json as of now; ``write_save`` adds the indexes' checksums ("ranks", last)."""
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
    }
