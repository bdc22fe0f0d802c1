"""A model's weights as transformers lays them out in a directory: one
``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` shards with
a ``model.safetensors.index.json`` that maps each tensor to its file.
Written by ``zcore consolidate`` and ``zcore.save_pretrained``."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from zcore.checkpoint import durable
from zcore.checkpoint.tensor_file import TensorSpec

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
WEIGHT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")


def weight_file_names(count: int) -> list[str]:
    return [WEIGHTS] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def write_index(out: Path, names: list[str], files: list[list[TensorSpec]]) -> None:
    """The index of ``files`` (each file's tensors) written as ``names``."""
    weight_map = {spec.name: name for name, file_specs in zip(names, files) for spec in file_specs}
    total = sum(spec.nbytes for file_specs in files for spec in file_specs)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    durable.write_bytes(out / INDEX, json.dumps(index, indent=2, sort_keys=True).encode())


def staging_directory(out: Path, doing: str) -> Path:
    """Where a writer of ``out`` stages its files: a hidden directory of
    its own inside ``out``, so that the final renames stay on one filesystem."""
    return out / f".zcore-{doing}-{os.getpid()}-{time.time_ns()}"


def publish(staging: Path, out: Path, written: list[str]) -> list[Path]:
    """Moves the staged files into ``out``: the old index goes first and the
    new one comes last, so a crash between leaves no index that names files
    of two saves; then weight files of the earlier save that the new one
    does not replace (another split) are removed."""
    (out / INDEX).unlink(missing_ok=True)
    for name in sorted(written, key=lambda n: n == INDEX):
        os.replace(staging / name, out / name)
    durable.fsync_dir(out)
    durable.remove_tree(staging)
    kept = set(written)
    for path in out.iterdir():
        if WEIGHT_FILE.fullmatch(path.name) and path.name not in kept:
            path.unlink()
    return [out / name for name in written]
