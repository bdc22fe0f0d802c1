"""What one rank writes into a checkpoint, and the writing of it.

A ``RankPayload`` holds the names, dtypes and shapes of the tensors of the
rank's two files (weights, then optimizer states and RNG), the index
entries beside them (ranges, per-parameter scalars, RNG as JSON) and a
stream of the tensors in file order. A synchronous save streams them from
where they live (states on NVMe read a sub-group at a time:
zcore.checkpoint.slot_values); an asynchronous save first copies the stream
into host memory (zcore.checkpoint.snapshot) and writes the copy later, so
that both write the same bytes by the same code.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from zcore.memory.aio import AioEngine
from zcore.checkpoint import directory, durable, matrix_states, training_state
from zcore.checkpoint.layout import FROZEN, TRAINED, EngineLayout
from zcore.checkpoint.slot_values import SlotValues
from zcore.checkpoint.tensor_file import TensorFileWriter, TensorSpec
from zcore.progress import progress_bar

WEIGHTS, STATE = "weights", "state"  # the file a streamed tensor belongs to

# (WEIGHTS or STATE, the tensor, whether it is settled: changed only by the
# optimizer step or a load, as trained values, their states and frozen
# parameters are; buffers change in forwards, client_state tensors anywhere).
Stream = Callable[[], Iterator[tuple[str, torch.Tensor, bool]]]


@dataclass(frozen=True)
class RankPayload:
    rank: int
    weight_specs: list[TensorSpec]
    state_specs: list[TensorSpec]
    ranges: dict[str, dict]
    scalars: dict[str, dict]
    rng: dict[str, Any]
    # ``values()``: (WEIGHTS or STATE, tensor, settled) in the order of the
    # specs of each file; a tensor is valid until the next one is asked for,
    # except where ``in_memory``: then every tensor is a view of the live
    # value, valid until that value changes.
    values: Stream
    in_memory: bool

    @property
    def nbytes(self) -> int:
        """The bytes of tensor data in both files."""
        return sum(spec.nbytes for spec in self.weight_specs + self.state_specs)


def rank_payload(engine: Any, layout: EngineLayout, client_tensors: dict[str, torch.Tensor]) -> RankPayload:
    """This rank's payload, streaming from the engine's live state (and RNG
    state taken now). ``client_tensors``: rank 0's client_state tensors."""
    rank = engine.context.rank
    values = SlotValues(engine)
    saved = [s for s in layout.slots if s.saves]
    trained = layout.slots_of(TRAINED)
    ranges = {s.name: {"file": WEIGHTS, "of": s.name, "start": s.start, "stop": s.stop} for s in saved}
    state_specs: list[TensorSpec] = []
    scalars: dict[str, dict] = {}
    for slot in trained:
        template = values.state_template(slot) if slot.saves else None
        if template is None:
            continue
        ranged, scalar = training_state.split_state(template, slot.data.numel(), slot.name)
        for key, value in ranged.items():
            state_specs.append(TensorSpec(f"{slot.name}::{key}", value.dtype, (slot.data.numel(),)))
            ranges[f"{slot.name}::{key}"] = {"file": STATE, "of": slot.name, "state": key,
                                             "start": slot.start, "stop": slot.stop}
        scalars[slot.name] = scalar
    rng, extra = training_state.rng_state(engine.context.device)
    extra.update(matrix_states.saved_tensors(engine, layout))
    if rank == 0:
        extra.update(client_tensors)
    state_specs += [TensorSpec(k, v.dtype, tuple(v.shape)) for k, v in extra.items()]
    weight_specs = [TensorSpec(s.name, s.data.dtype, (s.data.numel(),)) for s in saved]

    def stream() -> Iterator[tuple[str, torch.Tensor, bool]]:
        for slot, data, state in values.trained(trained):  # first in the layout, so first in both files
            if not slot.saves:
                continue
            yield WEIGHTS, data, True
            if slot.name in scalars:
                ranged, _ = training_state.split_state(state, slot.data.numel(), slot.name)
                for value in ranged.values():
                    yield STATE, value, True
        for slot in saved:
            role = layout.tensors[slot.name].role
            if role != TRAINED:
                yield WEIGHTS, values.frozen(slot), role == FROZEN
        for value in extra.values():
            yield STATE, value, False

    in_memory = not values.swapped and all(
        s.group is None or s.group.in_memory for s in saved if layout.tensors[s.name].role != TRAINED
    )
    return RankPayload(rank, weight_specs, state_specs, ranges, scalars, rng, stream, in_memory)


def write_payload(payload: RankPayload, staging: Path, tag: str, show_progress: bool = True) -> str:
    """The weights and state files of ``payload`` in ``staging``, then its
    index (ranges and checksums of both); returns the index's checksum.
    Both files are written in one pass over the values, so that states on
    NVMe are read once."""
    io = AioEngine(staging)  # O_DIRECT writes: zcore.checkpoint.direct_file
    rank = payload.rank
    with (
        TensorFileWriter(staging / directory.weights_file(rank), payload.weight_specs, engine=io) as weights_out,
        TensorFileWriter(staging / directory.state_file(rank), payload.state_specs, engine=io) as state_out,
        progress_bar(f"saving checkpoint {tag}", payload.nbytes, enabled=show_progress) as bar,
    ):
        files = {WEIGHTS: weights_out, STATE: state_out}
        for file, value, _ in payload.values():
            files[file].write(value)
            bar.update(value.nbytes)
        weights = weights_out.commit()
        state = state_out.commit()
    index = {
        "rank": rank,
        "files": {WEIGHTS: weights.to_json(), STATE: state.to_json()},
        "ranges": payload.ranges,
        "scalars": payload.scalars,
        "rng": payload.rng,
    }
    return durable.write_json(staging / directory.rank_index(rank), index)
