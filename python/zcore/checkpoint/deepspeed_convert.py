"""``zcore convert --from deepspeed``: a zcore checkpoint from DeepSpeed's, in one process.

The zcore checkpoint keeps DeepSpeed's world size: its rank R holds the
element ranges DeepSpeed's rank R held (zcore's format records ranges of
each parameter, which any world size loads), so each DeepSpeed rank file
is read, written out and dropped before the next. Frozen parameters,
buffers and the client_state go with rank 0. DeepSpeed saves no RNG state:
every rank's record holds the converting process's, which
``engine.load_checkpoint`` then sets on the ranks below that world size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from zcore.checkpoint import directory, durable, partials, training_state
from zcore.checkpoint.deepspeed_files import MOMENTS, DeepSpeedCheckpoint, open_checkpoint, read_rank
from zcore.checkpoint.deepspeed_format import hyperparameters_of, meta_of
from zcore.checkpoint.tensor_file import TensorFileWriter, TensorSpec
from zcore.errors import CheckpointError


def convert_deepspeed_checkpoint(source: str | Path, destination: str | Path, tag: Optional[str] = None) -> Path:
    """Writes DeepSpeed checkpoint ``source`` (its ``tag``, default the one
    ``latest`` names) as a zcore checkpoint under ``destination``, the same
    tag, and points ``destination/latest`` at it; returns the tag directory."""
    checkpoint = open_checkpoint(source, tag)
    name = directory.check_tag(checkpoint.tag_dir.name)
    root = Path(destination)
    durable.make_dir(root, parents=True, exist_ok=True)
    directory.check_tag_free(root, name)
    staging = directory.staging_dir(root, name)
    partials.start(staging)
    try:
        client_json, client_tensors = training_state.encode_client_state(checkpoint.client_state)
        checksums, param_groups = [], []
        for rank in range(checkpoint.world_size):
            checksum, groups = _write_rank(checkpoint, rank, staging, client_tensors if rank == 0 else {})
            checksums.append(checksum)
            param_groups = param_groups or groups
        meta = meta_of(checkpoint, hyperparameters_of(param_groups), checksums, client_json)
        durable.write_json(staging / directory.META, meta)
        durable.replace_dir(staging, root / name)
        durable.write_bytes(root / directory.LATEST, name.encode())
    except BaseException:
        durable.remove_tree(staging)
        raise
    return root / name


def _write_rank(
    checkpoint: DeepSpeedCheckpoint, rank: int, staging: Path, extra: dict[str, torch.Tensor]
) -> tuple[str, list[dict]]:
    """zcore's rank ``rank``: DeepSpeed's rank file cut into ranges of each
    parameter; returns its index's checksum and DeepSpeed's optimizer groups."""
    state = read_rank(checkpoint, rank)
    weights: dict[str, torch.Tensor] = {}
    states: dict[str, torch.Tensor] = {}
    ranges: dict[str, dict] = {}
    scalars: dict[str, dict] = {}
    for g, flat in enumerate(state.flats):
        for piece in checkpoint.pieces(rank, g, flat.numel()):
            if piece.start == piece.stop:
                continue
            values = slice(piece.offset, piece.offset + piece.stop - piece.start)
            weights[piece.name] = flat[values]
            ranges[piece.name] = {"file": "weights", "of": piece.name, "start": piece.start, "stop": piece.stop}
            if state.steps[g] is None:
                continue
            for key in MOMENTS:
                states[f"{piece.name}::{key}"] = state.moments[g][key][values]
                ranges[f"{piece.name}::{key}"] = {"file": "state", "of": piece.name, "state": key,
                                                  "start": piece.start, "stop": piece.stop}
            scalars[piece.name] = {"step": {"value": state.steps[g], "dtype": "float32", "shape": []}}
    if rank == 0:
        for name, value in checkpoint.module.items():
            weights[name] = value.reshape(-1)
            ranges[name] = {"file": "weights", "of": name, "start": 0, "stop": value.numel()}
    if len(set(weights)) != len(weights):
        raise CheckpointError(f"{checkpoint.optim_files[rank]} holds a parameter twice")
    rng, rng_tensors = training_state.rng_state(torch.device("cpu"))
    states.update(rng_tensors)
    states.update(extra)
    records = {}
    for kind, tensors, file_name in (("weights", weights, directory.weights_file(rank)),
                                     ("state", states, directory.state_file(rank))):
        specs = [TensorSpec(key, value.dtype, (value.numel(),) if key in ranges else tuple(value.shape))
                 for key, value in tensors.items()]
        with TensorFileWriter(staging / file_name, specs) as writer:
            for value in tensors.values():
                writer.write(value.contiguous())
            records[kind] = writer.commit().to_json()
    index = {"rank": rank, "files": records, "ranges": ranges, "scalars": scalars, "rng": rng}
    return durable.write_json(staging / directory.rank_index(rank), index), state.param_groups
