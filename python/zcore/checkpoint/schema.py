"""What a checkpoint's metadata may hold: ``meta.json`` and the rank
indexes, validated before any of it reaches the engine.

A checksum that matches says the bytes are the ones written, not that a
trusted program wrote them: xxh3 detects damage, not tampering, and anyone
can edit a file and re-sign it. So every value is checked against what zcore
writes (types strict, no unknown keys, counters non-negative, element ranges
inside their tensor, dtypes from the known set, names plain), and load
works only from the typed records below, never from the raw JSON.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)

from zcore.checkpoint import directory
from zcore.checkpoint.files import shown
from zcore.errors import CheckpointCorruptError

_LIMIT = 2**62  # counters, sizes, element offsets


def _plain_text(value: str) -> str:
    if any(ord(c) < 0x20 or c == "\x7f" for c in value) or "::" in value:
        raise ValueError("must hold no control characters and no '::'")
    return value


Count = Annotated[StrictInt, Field(ge=0, le=_LIMIT)]
Finite = Annotated[float, Field(strict=True, allow_inf_nan=False)]  # an int is accepted as well
TensorName = Annotated[StrictStr, Field(min_length=1, max_length=1000), AfterValidator(_plain_text)]
Key = Annotated[StrictStr, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")]  # optimizer state, group keys
FileName = Annotated[StrictStr, AfterValidator(lambda v: directory.check_name(v, "file name"))]
Checksum = Annotated[StrictStr, Field(pattern=r"^[0-9a-f]{16}$")]
DtypeName = Literal["float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"]
Shape = Annotated[list[Count], Field(max_length=16)]
Scalar = Optional[StrictBool | StrictInt | Finite | Annotated[StrictStr, Field(max_length=1000)]]


class Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def _numel(shape: list[int]) -> int:
    numel = math.prod(shape)
    if numel > _LIMIT:
        raise ValueError(f"shape {shape} has more than 2**62 elements")
    return numel


# meta.json
class PartsRecord(Record):
    """A tensor-parallel tensor: stored as parts joined along ``dim``."""

    dim: Annotated[StrictInt, Field(ge=0, le=15)]
    names: Annotated[list[TensorName], Field(min_length=1, max_length=1 << 16)]


class TensorRecord(Record):
    shape: Shape
    dtype: DtypeName
    role: Literal["trained", "frozen", "buffer"]
    parts: Optional[PartsRecord] = None

    @model_validator(mode="after")
    def _bounded(self) -> TensorRecord:
        _numel(self.shape)
        return self


class Counters(Record):
    """The engine's step counters (zcore.Engine.restore_counters)."""

    global_steps: Count
    global_samples: Count
    micro_steps: Count
    skipped_steps: Count

    @model_validator(mode="after")
    def _ordered(self) -> Counters:
        if not self.skipped_steps <= self.global_steps <= self.micro_steps:
            raise ValueError("skipped_steps <= global_steps <= micro_steps must hold")
        return self


class OptimizerRecord(Record):
    kind: Key
    groups: list[list[TensorName]]
    hyperparameters: list[dict[Key, Scalar | Annotated[list[Scalar], Field(max_length=16)]]]

    @model_validator(mode="after")
    def _one_per_group(self) -> OptimizerRecord:
        if len(self.hyperparameters) != len(self.groups):
            raise ValueError(f"{len(self.groups)} groups but {len(self.hyperparameters)} hyperparameter sets")
        return self


class ScalerState(Record):
    """A loss scaler's state: {} (none), {scale} (static) or all four (dynamic)."""

    scale: Optional[Annotated[Finite, Field(gt=0)]] = None
    iteration: Optional[Count] = None
    last_overflow_iteration: Optional[Annotated[StrictInt, Field(ge=-1, le=_LIMIT)]] = None
    hysteresis_left: Optional[Count] = None

    @model_validator(mode="after")
    def _complete(self) -> ScalerState:
        dynamic = [self.iteration, self.last_overflow_iteration, self.hysteresis_left]
        if any(v is not None for v in dynamic) and (None in dynamic or self.scale is None):
            raise ValueError("a dynamic scaler's state has scale, iteration, last_overflow_iteration and hysteresis_left")
        return self

    def as_dict(self) -> dict:
        return self.model_dump(exclude_none=True)


class Meta(Record):
    format: Literal["zcore-checkpoint"]
    version: Annotated[StrictInt, Field(ge=1, le=directory.VERSION)]
    tag: Annotated[StrictStr, AfterValidator(directory.check_tag)]
    world_size: Annotated[StrictInt, Field(ge=1, le=1 << 20)]
    zero_stage: Annotated[StrictInt, Field(ge=0, le=3)]
    offload_optimizer: Literal["none", "cpu", "nvme"]
    compute_dtype: Literal["float32", "bfloat16", "float16"]
    config: dict[str, JsonValue]  # the saving engine's config, for people: load never applies it
    counters: Counters
    tensors: dict[TensorName, TensorRecord]
    keys: dict[TensorName, TensorName]
    optimizer: OptimizerRecord
    loss_scaler: ScalerState
    lr_scheduler: Optional[dict[str, JsonValue]]  # checked against the engine's scheduler when applied
    client_state: JsonValue
    ranks: list[Checksum]

    @model_validator(mode="after")
    def _consistent(self) -> Meta:
        if len(self.ranks) != self.world_size:
            raise ValueError(f"ranks lists {len(self.ranks)} indexes for world_size {self.world_size}")
        unknown = sorted(set(self.keys.values()) - set(self.tensors))
        if unknown:
            raise ValueError(f"keys name tensors that tensors lacks: {unknown[:3]}")
        for name, record in self.tensors.items():
            if record.parts is not None:
                _check_parts(name, record, self.tensors)
        trained = [n for g in self.optimizer.groups for n in g]
        wrong = [n for n in trained if self.tensors.get(n, None) is None or self.tensors[n].role != "trained"]
        if wrong or len(set(trained)) != len(trained):
            raise ValueError(f"optimizer groups must list trained tensors once each: {wrong[:3] or 'repeated names'}")
        return self


# rank-R.json
class FileRecordModel(Record):
    name: FileName
    bytes: Count
    header: Checksum
    tensors: dict[Annotated[StrictStr, Field(min_length=1, max_length=2100)], Checksum]


class Files(Record):
    weights: FileRecordModel
    state: FileRecordModel


class RangeRecord(Record):
    file: Literal["weights", "state"]
    of: TensorName
    state: Optional[Key] = None
    start: Count
    stop: Count

    @model_validator(mode="after")
    def _ordered(self) -> RangeRecord:
        if self.start > self.stop:
            raise ValueError(f"start {self.start} lies after stop {self.stop}")
        if (self.file == "state") != (self.state is not None):
            raise ValueError("a range of the state file names its optimizer state key, one of weights none")
        return self

    @property
    def key(self) -> str:
        """Its tensor's name in the file."""
        return self.of if self.state is None else f"{self.of}::{self.state}"


class ScalarState(Record):
    """One scalar of a parameter's optimizer state; with dtype and shape, a
    one-element tensor (Adam's step)."""

    value: Optional[StrictBool | StrictInt | Finite]
    dtype: Optional[DtypeName] = None
    shape: Optional[Annotated[list[Count], Field(max_length=8)]] = None

    @model_validator(mode="after")
    def _tensor(self) -> ScalarState:
        if (self.dtype is None) != (self.shape is None):
            raise ValueError("a tensor scalar has both dtype and shape")
        if self.dtype is not None and (self.value is None or _numel(self.shape) != 1):
            raise ValueError("a tensor scalar is one number")
        return self


def _uint32s(length: int):
    return Annotated[list[Annotated[StrictInt, Field(ge=0, lt=2**32)]], Field(min_length=length, max_length=length)]


class PythonRng(Record):
    """random.getstate(): version 3, 624 words and a position, the cached gauss."""

    version: Annotated[StrictInt, Field(ge=3, le=3)]
    words: _uint32s(625)
    gauss: Optional[Finite]


class NumpyRng(Record):
    """numpy.random.get_state()."""

    name: Literal["MT19937"]
    keys: _uint32s(624)
    pos: Annotated[StrictInt, Field(ge=0, le=624)]
    has_gauss: Annotated[StrictInt, Field(ge=0, le=1)]
    cached: Finite


class RngRecord(Record):
    python: PythonRng
    numpy: Optional[NumpyRng] = None

    @model_validator(mode="before")
    @classmethod
    def _named(cls, value: Any) -> Any:
        """Saved as JSON arrays: named here, so each part has its own type."""
        if not isinstance(value, dict):
            return value
        out = dict(value)
        for key, model in (("python", PythonRng), ("numpy", NumpyRng)):
            part = out.get(key)
            if isinstance(part, list) and len(part) == len(model.model_fields):
                out[key] = dict(zip(model.model_fields, part))
            elif isinstance(part, list):
                raise ValueError(f"{key} holds {len(part)} values, not {len(model.model_fields)}")
        return out


class RankIndex(Record):
    rank: Annotated[StrictInt, Field(ge=0, lt=1 << 20)]
    files: Files
    ranges: dict[Annotated[StrictStr, Field(min_length=1, max_length=2100)], RangeRecord]
    scalars: dict[TensorName, dict[Key, ScalarState]]
    rng: RngRecord

    @model_validator(mode="after")
    def _consistent(self) -> RankIndex:
        for kind, record in (("weights", self.files.weights), ("state", self.files.state)):
            expected = getattr(directory, f"{kind}_file")(self.rank)
            if record.name != expected:
                raise ValueError(f"rank {self.rank}'s {kind} file is {expected}, not {record.name}")
        for key, r in self.ranges.items():
            if key != r.key:
                raise ValueError(f"range {key!r} is stored as {r.key!r}")
            if key not in getattr(self.files, r.file).tensors:
                raise ValueError(f"range {key!r} is not in the {r.file} file's tensors")
        return self


def _path(loc: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or "(top level)"


def invalid(path: Path, field: str, problem: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"checkpoint file {path}: {field}: {problem}. Its checksum matches, so it was written this way or "
        "edited and re-signed (xxh3 detects damage, not tampering); zcore refuses it: load a "
        "checkpoint from a trusted source",
        path=str(path),
        field=field,
    )


def validated(model: type[Record], content: Any, path: Path) -> Any:
    """``content`` as ``model``; CheckpointCorruptError naming the file and
    the first field that does not fit."""
    try:
        return model.model_validate(content)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise invalid(path, _path(first["loc"]), f"{first['msg']} (got {shown(first.get('input'))})") from None
    except RecursionError:
        raise invalid(path, "(top level)", "nested too deeply") from None


def _check_parts(name: str, record: TensorRecord, tensors: dict[str, TensorRecord]) -> None:
    """The parts exist, are plain tensors of the same dtype and role, and
    join along ``dim`` into the tensor's shape."""
    dim, parts = record.parts.dim, record.parts.names
    if dim >= len(record.shape):
        raise ValueError(f"{name}'s parts join along dimension {dim} of a {len(record.shape)}-d tensor")
    joined = 0
    for part in parts:
        info = tensors.get(part)
        if info is None or info.parts is not None or (info.dtype, info.role) != (record.dtype, record.role):
            raise ValueError(f"{name}'s part {part} is not a tensor of its dtype and role")
        if len(info.shape) != len(record.shape) or (
            info.shape[:dim] + info.shape[dim + 1 :] != record.shape[:dim] + record.shape[dim + 1 :]
        ):
            raise ValueError(f"{name}'s part {part} has shape {info.shape}, which does not join into {record.shape}")
        joined += info.shape[dim]
    if joined != record.shape[dim] or len(set(parts)) != len(parts):
        raise ValueError(f"{name}'s parts join into {joined} along dimension {dim}, not {record.shape[dim]}")


def check_index(index: RankIndex, position: int, meta: Meta, path: Path) -> None:
    """An index as ``meta`` lists it: its rank, ranges inside their tensors."""
    if index.rank != position:
        raise invalid(path, "rank", f"is {index.rank}, the file is rank {position}'s")
    for key, r in index.ranges.items():
        info = meta.tensors.get(r.of)
        if info is None:
            raise invalid(path, f"ranges.{key}.of", f"names {shown(r.of)}, which meta.json's tensors lack")
        if r.stop > _numel(info.shape):
            raise invalid(path, f"ranges.{key}.stop", f"{r.stop} lies past the end of {r.of} ({_numel(info.shape)} elements)")
    for name in index.scalars:
        if name not in meta.tensors or meta.tensors[name].role != "trained":
            raise invalid(path, f"scalars.{name}", "names no trained tensor of meta.json")
