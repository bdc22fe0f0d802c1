"""Hugging Face model directories in and out of a running engine, streamed.

``save_pretrained`` writes what transformers' ``from_pretrained`` reads: the
model's config (and generation config) and its weights as safetensors
files, split at a maximum size with a ``model.safetensors.index.json`` when
there are several. Tensors are gathered one unit at a time onto rank 0 and
written as they arrive (every name, dtype and shape is known up front, so
each file's header goes first): no rank ever holds the whole model. Tied
parameters are written once, under their first name, as transformers does.

``load_pretrained`` reads such a directory (one file, or shards with their
index) straight into each rank's shards: every rank reads only the element
ranges it keeps, so a rank's memory grows by its own shards, never by the
model. The values are staged and checked on every rank first, and the
engine's state is replaced only once every rank succeeded
(zcore.checkpoint.load's two phases).
"""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path
from typing import Any, Optional, Union

import torch
from tqdm import tqdm

from zcore import arguments
from zcore.comm import collectives as comm
from zcore.checkpoint import durable
from zcore.checkpoint.files import read_small, size_in_bytes
from zcore.checkpoint.full_state import full_state_tensors, refuse_model_parallel, tensor_order
from zcore.checkpoint.hf_names import CheckpointNames
from zcore.checkpoint.layout import TRAINED, EngineLayout, engine_layout
from zcore.checkpoint.load import Staged, as_checkpoint_error, commit_when_all_staged, stage_nvme
from zcore.checkpoint.slot_values import SlotValues
from zcore.checkpoint.tensor_file import TensorFileReader, TensorFileWriter, TensorSpec, plan_files
from zcore.checkpoint.weight_files import (
    INDEX,
    WEIGHTS,
    publish,
    staging_directory,
    weight_file_names,
    write_index,
)
from zcore.errors import CheckpointError, CheckpointMismatchError, ZcoreError
from zcore.progress import progress_bar

log = logging.getLogger("zcore")

_FILE_IN_DIRECTORY = re.compile(r"[A-Za-z0-9_.\-]+\.safetensors")  # what an index may name: no paths
_MAX_INDEX_BYTES = 64 * 2**20


def save_pretrained(
    engine: Any,
    save_directory: Union[str, Path],
    dtype: torch.dtype = torch.float32,
    max_shard_size: Union[int, str] = 5 * 2**30,
) -> Optional[list[Path]]:
    """Writes a Hugging Face model directory from the engine; call it on every
    rank. Floating-point weights are written in ``dtype`` (fp32 by default:
    the master weights), in files of at most ``max_shard_size`` (bytes, or
    a size such as "5GB"). Returns the files written on rank 0, None elsewhere.

    The files are written aside and take their names only once every rank
    has done its part, so a save that fails (a full disk, a rank's NVMe
    error) leaves the directory's earlier weights as they were."""
    dtype = arguments.dtype(dtype, "dtype", arguments.FLOATING_DTYPES)
    engine.lifetime.check_usable()
    refuse_model_parallel(engine, "zcore.save_pretrained")
    engine._finish_step()
    shard_bytes = size_in_bytes(max_shard_size) if isinstance(max_shard_size, str) else max_shard_size
    layout = engine_layout(engine)
    files = plan_files([_spec(name, layout, dtype) for name in tensor_order(engine, layout)], shard_bytes)
    names = weight_file_names(len(files))
    out = Path(save_directory)
    rank0 = engine.context.rank == 0
    failures: list[BaseException] = []
    staging = staging_directory(out, "saving") if rank0 else None
    # Every rank runs every gather to the end, whatever fails: a rank that
    # stopped early would leave the others waiting in a collective.
    tensors = full_state_tensors(engine, layout, dtype, failures)
    written: list[str] = []
    try:
        if staging is not None:
            durable.make_dir(staging, parents=True)
            total = sum(spec.nbytes for file_specs in files for spec in file_specs)
            with progress_bar(f"saving weights to {out.name}", total) as bar:
                written = _write_weights(staging, names, files, tensors, bar)
            written += _write_configs(engine.module, staging, dtype)
    except BaseException as exc:  # noqa: BLE001 - every rank must learn of it
        failures.append(exc)
    for _ in tensors:  # the rest of the gathers, where writing stopped early (the others' whole part)
        pass
    failure = failures[0] if failures else None
    try:
        comm.raise_if_any_failed(
            failure if failure is None or isinstance(failure, ZcoreError) else CheckpointError(
                f"saving a Hugging Face directory to {out} failed: {type(failure).__name__}: {str(failure)[:500]}"
            ),
            f"saving a Hugging Face directory to {out}",
            CheckpointError,
        )
    except BaseException:
        if staging is not None:
            durable.remove_tree(staging)
        raise
    if staging is None:
        return None
    return publish(staging, out, written)


def _spec(name: str, layout: EngineLayout, dtype: torch.dtype) -> TensorSpec:
    info = layout.tensors[name]
    return TensorSpec(name, dtype if info.dtype.is_floating_point else info.dtype, info.shape)


def _write_weights(
    out: Path, names: list[str], files: list[list[TensorSpec]], tensors: Any, progress: tqdm
) -> list[str]:
    written = []
    for file_name, file_specs in zip(names, files):
        with TensorFileWriter(out / file_name, file_specs) as writer:
            for spec in file_specs:
                name, value = next(tensors)
                if name != spec.name:  # tensor_order and full_state_tensors disagree: a bug, never a wrong file
                    raise AssertionError(f"expected tensor {spec.name!r}, got {name!r}")
                writer.write(value)
                progress.update(value.nbytes)
                del value  # before the next tensor is gathered
            writer.commit()
        written.append(file_name)
    if len(files) > 1:
        write_index(out, names, files)
        written.append(INDEX)
    return written


def _write_configs(module: torch.nn.Module, out: Path, dtype: torch.dtype) -> list[str]:
    """The model's config as transformers writes it beside the weights (its
    class as the architecture, the weights' dtype), and its generation
    config; nothing for a model without a config."""
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        return []
    config.architectures = [type(module).__name__]
    config.dtype = str(dtype).removeprefix("torch.")
    config.save_pretrained(out)
    written = ["config.json"]
    generation = getattr(module, "generation_config", None)
    can_generate = getattr(module, "can_generate", None)
    if generation is not None and callable(can_generate) and can_generate():
        generation.save_pretrained(out)
        written.append("generation_config.json")
    return written


def load_pretrained(engine: Any, directory: Union[str, Path], strict: bool = True) -> tuple[list[str], list[str]]:
    """Loads the weights of a Hugging Face model directory into the engine;
    call it on every rank. Returns (missing, unexpected) tensor names, as
    ``load_state_dict`` does; with ``strict`` either is an error, and
    without it a tensor missing from the files keeps its current values."""
    engine.lifetime.check_usable()
    refuse_model_parallel(engine, "zcore.load_pretrained")
    engine._finish_step()
    layout = engine_layout(engine)
    values = SlotValues(engine)
    staged, failure, result = None, None, ([], [])
    try:
        with _PretrainedFiles(Path(directory)) as files:
            files.name_for(engine.module, {key: tuple(layout.tensors[name].shape) for key, name in layout.keys.items()})
            sources, result = _match(files, layout, engine.module, Path(directory), strict)
            # Missing tensors keep their values, those the model ignores when missing too.
            current = _current_values(values, layout, set(layout.tensors) - set(sources))
            total = _bytes_to_read(files, sources, layout)
            with progress_bar(f"loading weights from {Path(directory).name}", total) as bar:
                ranges = _Ranges(files, sources, current, bar)
                staged = Staged(None, layout)
                for slot in layout.slots:
                    if values.swapped and slot.piece is not None:
                        continue  # trained ranges on NVMe: staged by stage_nvme, a sub-group at a time
                    staged.slots.append((slot, ranges.read(slot.name, slot.start, slot.stop).to(slot.data.dtype)))
                stage_nvme(engine, layout, ranges, staged)
    except BaseException as exc:  # noqa: BLE001 - every rank must learn of it
        failure = as_checkpoint_error(exc, f"loading Hugging Face weights from {directory}")
    commit_when_all_staged(engine, staged, failure, f"loading Hugging Face weights from {directory}")
    return result


def _current_values(values: SlotValues, layout: EngineLayout, missing: set[str]) -> dict[str, list[tuple[int, torch.Tensor]]]:
    """Copies of this rank's ranges of the ``missing`` tensors, which keep
    their values: per name, (first element, values)."""
    current: dict[str, list[tuple[int, torch.Tensor]]] = {}
    if not missing:
        return current
    for slot, value, _ in values.trained(layout.slots_of(TRAINED)):
        if slot.name in missing:
            current.setdefault(slot.name, []).append((slot.start, value.clone()))
    for slot in layout.slots:
        if slot.name in missing and slot.piece is None:
            current.setdefault(slot.name, []).append((slot.start, values.frozen(slot).clone()))
    return current


class _PretrainedFiles:
    """The weight files of a directory, which holds each tensor, and the
    tensors as the model names them (``name_for``: zcore.checkpoint.hf_names)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        index, single = directory / INDEX, directory / WEIGHTS
        if index.is_file():
            weight_map = _read_index(index)
        elif single.is_file():
            weight_map = None
        else:
            raise CheckpointError(
                f"{directory} holds neither {WEIGHTS} nor {INDEX}: not a Hugging Face model directory "
                "saved with safetensors (convert .bin weights with transformers' save_pretrained first)"
            )
        self._readers: dict[str, TensorFileReader] = {}
        try:
            if weight_map is None:
                self.file_of = {key: WEIGHTS for key in self._reader(WEIGHTS).entries}
            else:
                self.file_of = weight_map
                for key, name in weight_map.items():
                    if key not in self._reader(name).entries:
                        raise CheckpointError(f"{index} places tensor {key!r} in {name}, which does not hold it")
        except BaseException:
            self.close()
            raise

    def _reader(self, name: str) -> TensorFileReader:
        if name not in self._readers:
            self._readers[name] = TensorFileReader(self.directory / name)
        return self._readers[name]

    def name_for(self, module: torch.nn.Module, model_shapes: dict[str, tuple[int, ...]]) -> None:
        """From now on, keys are the model's names for the tensors (``model_shapes``: its state dict's)."""
        self.names = CheckpointNames(module, self.file_of, model_shapes, self._read_whole)

    def keys(self) -> list[str]:
        return self.names.keys()

    def is_converted(self, key: str) -> bool:
        return self.names.is_converted(key)

    def _read_whole(self, file_key: str) -> torch.Tensor:
        reader = self._reader(self.file_of[file_key])
        shape = reader.entries[file_key].shape
        return reader.read_range(file_key, 0, math.prod(shape)).view(shape)

    def _file_tensor(self, key: str) -> tuple[TensorFileReader, str]:
        """The reader and the file's key of the model-side name ``key``."""
        file_key = self.names.file_key[key]
        return self._reader(self.file_of[file_key]), file_key

    def shape(self, key: str) -> tuple[int, ...]:
        reader, file_key = self._file_tensor(key)
        return reader.entries[file_key].shape

    def dtype(self, key: str) -> torch.dtype:
        reader, file_key = self._file_tensor(key)
        return reader.entries[file_key].dtype

    def read_range(self, key: str, start: int, stop: int) -> torch.Tensor:
        if self.names.is_converted(key):
            return self.names.whole(key).reshape(-1)[start:stop].clone()  # a copy: the whole is dropped later
        reader, file_key = self._file_tensor(key)
        return reader.read_range(file_key, start, stop)

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()

    def __enter__(self) -> _PretrainedFiles:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()


def _read_index(path: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(read_small(path, _MAX_INDEX_BYTES))["weight_map"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path} is not a safetensors index (a JSON object with a weight_map): {exc}") from None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and _FILE_IN_DIRECTORY.fullmatch(v) for k, v in weight_map.items()
    ):
        raise CheckpointError(
            f"{path}: its weight_map must map tensor names to safetensors file names in the same directory"
        )
    return weight_map


def _match(
    files: _PretrainedFiles, layout: EngineLayout, module: torch.nn.Module, directory: Path, strict: bool
) -> tuple[dict[str, str], tuple[list[str], list[str]]]:
    """Which file key holds each of the model's tensors, checked for shape;
    and (missing, unexpected). As transformers' from_pretrained: a tied
    tensor under any of its names, keys with or without the model's
    ``base_model_prefix`` (a base model's weights in a model with a head,
    and back), and names the model class says to ignore."""
    prefix = getattr(module, "base_model_prefix", "") or ""

    def spellings(key: str) -> list[str]:
        if not prefix:
            return [key]
        if key.startswith(prefix + "."):
            return [key, key[len(prefix) + 1 :]]
        return [key, f"{prefix}.{key}"]

    aliases: dict[str, list[str]] = {}
    for key, name in layout.keys.items():
        aliases.setdefault(name, []).extend(spellings(key))
    sources = {}
    available = set(files.keys())
    for name, keys in aliases.items():
        found = next((k for k in keys if k in available), None)
        if found is not None:
            sources[name] = found
    known = {k for keys in aliases.values() for k in keys}
    missing = [n for n in aliases if n not in sources and not _ignored(module, "missing", n)]
    unexpected = [k for k in files.keys() if k not in known and not _ignored(module, "unexpected", k)]
    reshaped = [  # a converted tensor's shape is checked once it is built
        f"{key}: file {list(files.shape(key))}, model {list(layout.tensors[name].shape)}"
        for name, key in sources.items()
        if not files.is_converted(key) and tuple(files.shape(key)) != tuple(layout.tensors[name].shape)
    ]
    if reshaped or (strict and (missing or unexpected)):
        parts = []
        for label, names in (("missing from the files", missing), ("in the files but not in the model", unexpected),
                             ("with another shape", reshaped)):
            if names:
                parts.append(f"{label}: {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}")
        raise CheckpointMismatchError(
            f"the weights in {directory} are of another model; tensors " + "; ".join(parts)
            + ". Build the model from the config saved with them"
            + ("" if reshaped else ", or pass strict=False to load the tensors that match"),
            missing=missing, unexpected=unexpected, reshaped=reshaped,
        )
    if missing or unexpected:
        log.warning("zcore: %s: %d tensors missing from the files (%s), %d unexpected (%s)", directory,
                    len(missing), ", ".join(missing[:5]), len(unexpected), ", ".join(unexpected[:5]))
    return sources, (missing, unexpected)


def _ignored(module: torch.nn.Module, kind: str, key: str) -> bool:
    """transformers' _keys_to_ignore_on_load_missing / _unexpected patterns."""
    patterns = getattr(module, f"_keys_to_ignore_on_load_{kind}", None) or []
    return any(re.search(p, key) for p in patterns)


def _bytes_to_read(files: _PretrainedFiles, sources: dict[str, str], layout: EngineLayout) -> int:
    """What this rank reads from the files: its range of each tensor they hold."""
    return sum(
        (slot.stop - slot.start) * files.dtype(sources[slot.name]).itemsize
        for slot in layout.slots
        if slot.name in sources and not files.is_converted(sources[slot.name])
    )


class _Ranges:
    """What zcore.checkpoint.load's staging reads ranges from: element
    ranges of the model's tensors, from the files (or, for tensors missing
    from them, their current values); no optimizer states."""

    def __init__(
        self,
        files: _PretrainedFiles,
        sources: dict[str, str],
        current: dict[str, list[tuple[int, torch.Tensor]]],
        progress: tqdm,
    ) -> None:
        self._files = files
        self._sources = sources  # tensor name -> its key in the files
        self._current = current
        self._progress = progress  # advanced by the bytes read from the files

    def read(self, name: str, start: int, stop: int, state: Optional[str] = None) -> torch.Tensor:
        if name in self._sources:
            key = self._sources[name]
            value = self._files.read_range(key, start, stop)
            if not self._files.is_converted(key):  # a converted tensor's sources are read whole, uncounted
                self._progress.update(value.nbytes)
            return value
        for first, value in self._current[name]:
            if first <= start and stop <= first + value.numel():
                return value[start - first : stop - first]
        raise KeyError(f"no current values of {name}[{start}:{stop}]")

    def state_keys(self, name: str) -> list[str]:
        return []
