"""``zcore consolidate``: one state dict from a sharded checkpoint, offline.

Streams tensor by tensor: each tensor is assembled from the ranges the
ranks saved, cast, written to the output, and dropped before the next, so
memory stays near twice the largest tensor however large the model. The
output is what ``model.state_dict()`` of the original model holds (tied
parameters under each of their names; a tensor-parallel parameter whole,
its parts joined), as safetensors files split at a
maximum size with a ``model.safetensors.index.json`` when there are several.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from zcore import arguments
from zcore.checkpoint import durable
from zcore.checkpoint.layout import FROZEN, TensorInfo, tensor_infos
from zcore.checkpoint.load import read_indexes, read_meta, resolve
from zcore.checkpoint.saved_ranges import SavedRanges
from zcore.checkpoint.schema import Meta
from zcore.checkpoint.tensor_file import TensorFileWriter, TensorSpec, plan_files
from zcore.checkpoint.weight_files import INDEX, publish, staging_directory, weight_file_names, write_index
from zcore.errors import CheckpointError
from zcore.progress import progress_bar


def consolidate(
    checkpoint_dir: str | Path,
    output_dir: str | Path,
    tag: Optional[str] = None,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = 5 * 2**30,
    progress: bool = True,
) -> list[Path]:
    """Writes the checkpoint's state dict to ``output_dir``; returns the files.

    Floating-point tensors are written in ``dtype`` (fp32 by default: the
    master weights), others as saved. Load with
    ``safetensors.torch.load_file`` and ``model.load_state_dict``. With
    ``progress``, a bar on stderr when it is a terminal (zcore.progress)."""
    dtype = arguments.dtype(dtype, "dtype", arguments.FLOATING_DTYPES)
    tag_dir, meta, infos, keys = _open(checkpoint_dir, tag)
    specs = [
        TensorSpec(key, dtype if infos[name].dtype.is_floating_point else infos[name].dtype, infos[name].shape)
        for key, name in keys.items()
    ]
    files = plan_files(specs, max_shard_bytes)
    names = weight_file_names(len(files))
    out = Path(output_dir)
    created = not out.exists()
    durable.make_dir(out, parents=True, exist_ok=True)
    # Written aside and published as save_pretrained does: a failed run
    # leaves the directory as it was, and a new split replaces the old one
    # whole (loaders would read stale files or a stale index).
    staging = staging_directory(out, "consolidating")
    try:
        durable.make_dir(staging)
        _write(tag_dir, meta, infos, keys, staging, names, files, progress)
        if len(files) > 1:
            write_index(staging, names, files)
            names = [*names, INDEX]
    except BaseException:
        durable.remove_tree(staging)
        if created:
            out.rmdir()
        raise
    return publish(staging, out, names)


def consolidated_state_dict(
    checkpoint_dir: str | Path, tag: Optional[str] = None, dtype: torch.dtype = torch.float32, frozen: bool = True,
) -> dict[str, torch.Tensor]:
    """The checkpoint's state dict in memory (what ``consolidate`` writes,
    floating-point tensors in ``dtype``); without ``frozen``, the frozen
    parameters left out. Memory: the whole model."""
    dtype = arguments.dtype(dtype, "dtype", arguments.FLOATING_DTYPES)
    tag_dir, meta, infos, keys = _open(checkpoint_dir, tag)
    out: dict[str, torch.Tensor] = {}
    read: dict[str, torch.Tensor] = {}  # by tensor: tied keys share one, as in model.state_dict()
    with SavedRanges(tag_dir, read_indexes(tag_dir, meta)) as saved:
        for key, name in keys.items():
            if not frozen and infos[name].role == FROZEN:
                continue
            if name not in read:
                value = _whole(saved, infos, name)
                read[name] = value.to(dtype) if value.is_floating_point() else value
            out[key] = read[name]
    return out


def _open(checkpoint_dir: str | Path, tag: Optional[str]) -> tuple[Path, Meta, dict[str, TensorInfo], dict[str, str]]:
    """The tag directory, its record, its tensors and their state-dict keys."""
    checkpoint_dir = arguments.directory(checkpoint_dir, "checkpoint_dir")
    if not checkpoint_dir.is_dir():
        raise CheckpointError(f"the checkpoint directory {checkpoint_dir} does not exist (or is not a directory)")
    tag_dir = resolve(checkpoint_dir, tag)
    if tag_dir is None:
        raise CheckpointError(f"{checkpoint_dir} holds no 'latest' file: name the tag to consolidate")
    meta = read_meta(tag_dir)
    return tag_dir, meta, tensor_infos(meta.tensors), meta.keys


def _write(
    tag_dir: Path, meta: Meta, infos: dict[str, TensorInfo], keys: dict[str, str], out: Path,
    names: list[str], files: list[list[TensorSpec]], progress: bool,
) -> None:
    total = sum(s.nbytes for file_specs in files for s in file_specs)
    with SavedRanges(tag_dir, read_indexes(tag_dir, meta)) as saved, progress_bar(
        f"consolidating checkpoint {tag_dir.name}", total, enabled=progress
    ) as bar:
        for name, file_specs in zip(names, files):
            with TensorFileWriter(out / name, file_specs) as writer:
                for spec in file_specs:
                    value = _whole(saved, infos, keys[spec.name])
                    writer.write(value.to(spec.dtype))
                    del value
                    bar.update(spec.nbytes)
                writer.commit()


def _whole(saved: SavedRanges, infos: dict[str, TensorInfo], name: str) -> torch.Tensor:
    """Tensor ``name``'s saved value, its tensor-parallel parts joined."""
    info = infos[name]
    if info.parts is None:
        return saved.read(name, 0, info.numel).view(info.shape)
    dim, parts = info.parts
    return torch.cat([saved.read(p, 0, infos[p].numel).view(infos[p].shape) for p in parts], dim=dim)
