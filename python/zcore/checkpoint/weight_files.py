"""A model's weights as transformers lays them out in a directory: one
``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` shards with
a ``model.safetensors.index.json`` that maps each tensor to its file.
Written by ``zcore consolidate`` and ``zcore.save_pretrained``."""

from __future__ import annotations

import json
import re
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
