"""One file of the whole model's weights, as DeepSpeed's ``save_16bit_model``
writes it: a torch file (what ``torch.save`` of the state dict writes, which
``torch.load`` reads, ``weights_only`` too), or a safetensors file for a
name ending in ``.safetensors``.

The tensors are gathered one unit at a time onto rank 0 and written as they
arrive (zcore.checkpoint.full_state): every name, dtype and shape is known
up front, so the torch file's pickled state dict, which only refers to its
tensors' data records by key, goes first, and each tensor's record follows
when it is gathered. No rank holds the whole model. The file is written
under a temporary name and renamed once whole.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any, Optional, Union

import torch

from zcore.checkpoint import durable
from zcore.checkpoint.full_state import full_state_tensors, refuse_model_parallel, tensor_order
from zcore.checkpoint.layout import EngineLayout, engine_layout
from zcore.checkpoint.tensor_file import TensorFileWriter, TensorSpec
from zcore.comm import collectives as comm
from zcore.errors import CheckpointError, ZcoreError

_PICKLE_PROTOCOL = 2  # torch.save's default


def save_model_file(engine: Any, path: Union[str, Path], dtype: torch.dtype, exclude_frozen: bool) -> Optional[Path]:
    """Writes the engine's weights, floating point in ``dtype``, to ``path``
    on rank 0; without the parameters that do not require grad when
    ``exclude_frozen``. Collective: call it on every rank. Returns the path
    on rank 0, None elsewhere."""
    refuse_model_parallel(engine, "engine.save_16bit_model")
    path = Path(path)
    layout = engine_layout(engine)
    frozen = _frozen_names(engine, layout) if exclude_frozen else set()
    specs = [_spec(name, layout, dtype) for name in tensor_order(engine, layout) if name not in frozen]
    keys = {key: name for key, name in layout.keys.items() if name not in frozen}
    failures: list[BaseException] = []
    # Every rank runs every gather to the end, whatever fails: a rank that
    # stopped early would leave the others waiting in a collective.
    tensors = full_state_tensors(engine, layout, dtype, failures)
    try:
        if engine.context.rank == 0:
            durable.make_dir(path.parent, parents=True, exist_ok=True)
            safetensors = path.suffix == ".safetensors"
            writer = TensorFileWriter(path, specs) if safetensors else TorchFileWriter(path, specs, keys)
            with writer:
                for name, value in tensors:
                    if name not in frozen:
                        writer.write(value)
                    del value  # before the next tensor is gathered
                writer.commit()
    except BaseException as exc:  # noqa: BLE001 - every rank must learn of it
        failures.append(exc)
    for _ in tensors:  # the rest of the gathers, where writing stopped early (the others' whole part)
        pass
    failure = failures[0] if failures else None
    comm.raise_if_any_failed(
        failure if failure is None or isinstance(failure, ZcoreError) else CheckpointError(
            f"saving the model's weights to {path} failed: {type(failure).__name__}: {str(failure)[:500]}"
        ),
        f"saving the model's weights to {path}",
        CheckpointError,
    )
    return path if engine.context.rank == 0 else None


def _frozen_names(engine: Any, layout: EngineLayout) -> set[str]:
    return {layout.names[id(p)] for p in engine.module.parameters() if not p.requires_grad}


def _spec(name: str, layout: EngineLayout, dtype: torch.dtype) -> TensorSpec:
    info = layout.tensors[name]
    return TensorSpec(name, dtype if info.dtype.is_floating_point else info.dtype, info.shape)


class _Storage:
    """A tensor's data record in the file, by key: what torch's pickled
    tensors refer to (their persistent id)."""

    def __init__(self, key: str, spec: TensorSpec) -> None:
        self.key = key
        self.spec = spec


class _Tensor:
    """Pickles as torch pickles a contiguous CPU tensor over a whole storage."""

    def __init__(self, storage: _Storage) -> None:
        self.storage = storage

    def __reduce_ex__(self, protocol: Any) -> tuple:
        shape = self.storage.spec.shape
        stride, step = [], 1
        for size in reversed(shape):
            stride.insert(0, step)
            step *= max(size, 1)
        return (torch._utils._rebuild_tensor_v2, (self.storage, 0, tuple(shape), tuple(stride), False, {}))


def _storage_class(dtype: torch.dtype) -> type:
    """The storage class torch.save pickles for a tensor of ``dtype`` (by its own table)."""
    return getattr(torch, torch.storage._dtype_to_storage_type_map()[dtype])


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Storage):
            spec = obj.spec
            n = 1
            for size in spec.shape:
                n *= size
            return ("storage", _storage_class(spec.dtype), obj.key, "cpu", n)
        return None


class TorchFileWriter:
    """Writes a state dict as ``torch.save`` does (its zip format, through
    torch's own zip writer), streamed: ``keys`` (state-dict key -> tensor
    name: tied keys share a tensor, as in the module's state dict) are
    pickled first; then ``write`` each of ``specs``' tensors in order, then
    ``commit`` (fsync, rename)."""

    def __init__(self, path: Path, specs: list[TensorSpec], keys: dict[str, str]) -> None:
        self.path = Path(path)
        self.temp = self.path.with_name(f".{self.path.name}.tmp")
        self.specs = specs
        storages = {spec.name: _Storage(str(i), spec) for i, spec in enumerate(specs)}
        data = io.BytesIO()
        _Pickler(data, protocol=_PICKLE_PROTOCOL).dump({key: _Tensor(storages[name]) for key, name in keys.items()})
        self._written = 0
        self._file = torch._C.PyTorchFileWriter(str(self.temp))
        try:
            for name, value in (
                ("data.pkl", data.getvalue()),
                (".format_version", b"1"),
                (".storage_alignment", b"64"),
                ("byteorder", b"little"),
            ):
                self._file.write_record(name, value, len(value))
        except BaseException:
            self.abort()
            raise

    def write(self, tensor: torch.Tensor) -> None:
        spec = self.specs[self._written]
        if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise ValueError(
                f"{self.path.name}: tensor {spec.name!r} should be {spec.dtype} of shape {spec.shape}, "
                f"got {tensor.dtype} of shape {tuple(tensor.shape)}"
            )
        value = tensor.detach().contiguous().cpu()
        if value.storage_offset() or value.untyped_storage().nbytes() != value.nbytes:
            value = value.clone()  # a storage of its own: the record holds the whole storage
        self._file.write_record(f"data/{self._written}", value.untyped_storage(), value.nbytes)
        self._written += 1

    def commit(self) -> None:
        if self._written != len(self.specs):
            missing = [s.name for s in self.specs[self._written :]]
            raise RuntimeError(f"{self.path.name}: tensors {missing[:3]} were never written")
        self._file.write_end_of_file()
        self._file = None
        fd = os.open(self.temp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(self.temp, self.path)
        durable.fsync_dir(self.path.parent)

    def abort(self) -> None:
        self._file = None  # closes torch's writer
        self.temp.unlink(missing_ok=True)

    def __enter__(self) -> TorchFileWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
