"""A checkpoint DeepSpeed 0.19.8 wrote with ZeRO stage 1, 2 or 3, read
without DeepSpeed and without running code from its files.

    DIR/latest                                         the tag to resume from
    DIR/TAG/mp_rank_00_model_states.pt                 stages 1-2: module, param_shapes, scheduler, counters
    DIR/TAG/zero_pp_rank_R_mp_rank_00_model_states.pt  stage 3: the same, once per rank
    DIR/TAG/[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt   rank R's flat fp32 partitions, Adam states

DeepSpeed's files are pickles. They are read with ``torch.load(weights_only=True)``,
which builds only tensors, containers and the classes allowed here: stand-ins
registered under the names of the few DeepSpeed classes its state holds (the
loss scaler, the ZeRO stage enum, fragment addresses), which take their
fields as data and run nothing. Anything else is refused.

The fp32 master weights and Adam's moments are flat: per optimizer group,
each rank holds a partition of the group's parameters laid end to end
(stages 1-2, in ``param_shapes``' order; the last partition's padding
removed by DeepSpeed's state_dict or named in ``group_paddings``), or a
``ceil(numel / world_size)`` piece of every parameter (stage 3). ``read``
cuts them into element ranges of each parameter, reading one rank's file at
a time.
"""

from __future__ import annotations

import enum
import math
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from zcore.checkpoint.files import read_small, shown
from zcore.errors import CheckpointError, CheckpointMismatchError

LATEST = "latest"
_OPTIM_FILE = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt")
_MODEL_FILE = "mp_rank_00_model_states.pt"
_STAGE3_MODEL_FILE = "zero_pp_rank_0_mp_rank_00_model_states.pt"
# Keys of DeepSpeed's model states file; any other was the user's client_state.
_ENGINE_KEYS = {
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
    "ds_version", "checkpoint_parallel_dimensions", "num_experts",
}
MOMENTS = ("exp_avg", "exp_avg_sq")


# Stand-ins for the DeepSpeed classes its checkpoints pickle: allowed under
# DeepSpeed's names, they keep the pickled fields and do nothing else.
class _PickledFields:
    """An object the unpickler fills with its saved fields (no __setstate__)."""


class _LossScaler(_PickledFields):
    pass


class _FragmentAddress(_PickledFields):
    pass


class _ZeroStage(enum.IntEnum):
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


_ALLOWED = [
    (_LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_LossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (_ZeroStage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (_FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
]


def load_pickle(path: Path) -> dict:
    """One of DeepSpeed's files, on the CPU, building nothing outside the allow-list."""
    try:
        with torch.serialization.safe_globals(_ALLOWED):
            content = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{path} holds something other than DeepSpeed's checkpoint state ({str(exc).splitlines()[-1][:300]}); "
            "zcore loads DeepSpeed's files with torch.load(weights_only=True) and never runs code from "
            "them. Load only checkpoints DeepSpeed wrote, from a trusted source", path=str(path),
        ) from None
    except (OSError, RuntimeError, EOFError) as exc:
        raise CheckpointError(f"cannot read DeepSpeed checkpoint file {path}: {exc}", path=str(path)) from None
    if not isinstance(content, dict):
        raise CheckpointError(f"{path} holds a {type(content).__name__}, not DeepSpeed's state (a dict)", path=str(path))
    return content


def resolve_tag_dir(load_dir: Path, tag: Optional[str]) -> Path:
    """``load_dir/tag``, the tag read from ``latest`` when none is given."""
    if not load_dir.is_dir():
        raise CheckpointError(f"the DeepSpeed checkpoint directory {load_dir} does not exist (or is not a directory)")
    if tag is None:
        latest = load_dir / LATEST
        if not latest.is_file():
            raise CheckpointError(
                f"{load_dir} has no '{LATEST}' file naming the tag to load: pass the tag (one of "
                f"{sorted(p.name for p in load_dir.iterdir() if p.is_dir()) or 'none found'})"
            )
        tag = read_small(latest, 4096).decode("utf-8", "replace").strip()
    if not tag or "/" in tag or tag in (".", ".."):
        raise CheckpointError(f"tag {shown(tag)} is not a directory name in {load_dir}")
    tag_dir = load_dir / tag
    if not tag_dir.is_dir():
        raise CheckpointError(f"no checkpoint {tag_dir}: {load_dir} has no directory for tag {tag!r}")
    return tag_dir


@dataclass(frozen=True)
class _Piece:
    """Elements [start, stop) of a parameter, at ``offset`` in a rank's flat group."""

    name: str
    start: int
    stop: int
    offset: int


@dataclass
class DeepSpeedCheckpoint:
    """The model states of a DeepSpeed checkpoint, and where its optimizer files are."""

    tag_dir: Path
    stage: int
    world_size: int
    optim_files: list[Path]
    groups: list[dict[str, tuple[int, ...]]]  # per optimizer group: parameter name -> shape, in flat order
    module: dict[str, torch.Tensor]  # stages 1-2: every tensor (16-bit or fp32); stage 3: buffers
    buffer_names: list[str]
    frozen: dict[str, tuple[int, ...]]  # parameters without gradients, whole in ``module``
    aliases: dict[str, str]  # tied parameters: another name -> the name stored
    lr_scheduler: Optional[dict]
    counters: dict[str, int]
    config: dict
    client_state: dict
    optimizer_state: dict = field(default_factory=dict)  # rank 0's, without its flat tensors
    _partition_numel: list[int] = field(default_factory=list)  # stages 1-2: rank 0's partition of each group

    @property
    def compute_dtype(self) -> str:
        if self.config.get("fp16", {}).get("enabled"):
            return "float16"
        return "bfloat16" if self.config.get("bf16", {}).get("enabled") else "float32"

    def optimizer_kind(self) -> Optional[str]:
        """"Adam" or "AdamW" from ds_config's optimizer section, as DeepSpeed
        builds it; None for another (or a client's) optimizer."""
        section = self.config.get("optimizer") or {}
        kind = str(section.get("type", "")).lower()
        if kind == "adamw":
            return "AdamW"
        if kind == "adam":
            return "AdamW" if (section.get("params") or {}).get("adam_w_mode", True) else "Adam"
        return None

    def pieces(self, rank: int, group: int, numel_on_rank: int) -> list[_Piece]:
        """The parameter ranges rank ``rank``'s flat partition of ``group``
        holds, of ``numel_on_rank`` elements (stages 1-2: ranks before it hold
        ``rank * numel_on_rank``, as all partitions but the last are equal)."""
        shapes = self.groups[group]
        if self.stage == 3:
            out, offset = [], 0
            for name, shape in shapes.items():
                numel = math.prod(shape)
                per_rank = -(-numel // self.world_size)
                start = min(rank * per_rank, numel)
                out.append(_Piece(name, start, min(start + per_rank, numel), offset))
                offset += per_rank
            return out
        first = rank * self._partition_numel[group]
        out, position = [], 0
        for name, shape in shapes.items():
            numel = math.prod(shape)
            lo, hi = max(first, position), min(first + numel_on_rank, position + numel)
            if lo < hi:
                out.append(_Piece(name, lo - position, hi - position, lo - first))
            position += numel
        return out


def open_checkpoint(load_dir: str | Path, tag: Optional[str] = None) -> DeepSpeedCheckpoint:
    """Reads the model states and rank 0's optimizer state (to learn the
    partitioning); the other ranks' files are read by ``read_flat``."""
    tag_dir = resolve_tag_dir(Path(load_dir), tag)
    optim_files = _optim_files(tag_dir)
    model_path = tag_dir / _MODEL_FILE
    if not model_path.is_file():
        model_path = tag_dir / _STAGE3_MODEL_FILE
    if not model_path.is_file():
        raise CheckpointError(
            f"{tag_dir} holds optimizer files but neither {_MODEL_FILE} nor {_STAGE3_MODEL_FILE}: the "
            "checkpoint is incomplete", path=str(tag_dir),
        )
    model = load_pickle(model_path)
    first = load_pickle(optim_files[0]).get("optimizer_state_dict")
    if not isinstance(first, dict):
        raise CheckpointError(f"{optim_files[0]} has no optimizer_state_dict: not a DeepSpeed ZeRO optimizer file")
    stage = int(first.get("zero_stage", _ZeroStage.optimizer_states))  # BF16_Optimizer (stage 1) writes none
    partition_count = first.get("partition_count")
    world_size = max(partition_count) if isinstance(partition_count, list) else partition_count
    if world_size != len(optim_files):
        raise CheckpointError(
            f"{tag_dir}: its optimizer state was partitioned over {shown(world_size)} ranks, but the directory "
            f"holds {len(optim_files)} optimizer files: a rank's file is missing", path=str(tag_dir),
        )
    shapes = model.get("param_shapes")
    if not isinstance(shapes, list) or not shapes:
        raise CheckpointError(f"{model_path} has no param_shapes: not a DeepSpeed ZeRO checkpoint", path=str(model_path))
    groups = [{name: tuple(shape) for name, shape in group.items()} for group in shapes]
    if stage == 3:  # param_shapes lists sub-groups: joined into the optimizer's groups
        base = first.get("optimizer_state_dict") or {}
        groups = [{n: s for i in g["params"] for n, s in groups[i].items()} for g in base.get("param_groups", [])]
    if stage == 3 and model.get("frozen_param_shapes"):
        raise CheckpointError(
            f"{tag_dir}: a ZeRO-3 checkpoint with frozen parameters ({', '.join(list(model['frozen_param_shapes'])[:4])}): "
            "zcore reads DeepSpeed's ZeRO-3 checkpoints of fully trained models only", path=str(tag_dir),
        )
    module = model.get("module") or {}
    trained = {n for g in groups for n in g}
    buffers = list(model.get("buffer_names") or [])
    frozen = {n: tuple(t.shape) for n, t in module.items() if n not in trained and n not in buffers
              and isinstance(t, torch.Tensor) and stage < 3}
    checkpoint = DeepSpeedCheckpoint(
        tag_dir=tag_dir, stage=stage, world_size=world_size, optim_files=optim_files, groups=groups,
        module={n: t for n, t in module.items() if n in buffers or n in frozen}, buffer_names=buffers,
        frozen=frozen, aliases=dict(model.get("shared_params") or {}), lr_scheduler=model.get("lr_scheduler"),
        counters={k: int(model.get(k) or 0) for k in ("global_steps", "global_samples", "skipped_steps")},
        config=dict(model.get("ds_config") or {}),
        client_state={k: v for k, v in model.items() if k not in _ENGINE_KEYS},
        optimizer_state={k: v for k, v in first.items() if k not in ("single_partition_of_fp32_groups", "fp32_flat_groups")},
    )
    if stage < 3:
        checkpoint._partition_numel = [int(t.numel()) for t in _flat_groups(first, optim_files[0])]
    return checkpoint


def _optim_files(tag_dir: Path) -> list[Path]:
    found = {}
    for path in tag_dir.iterdir():
        match = _OPTIM_FILE.fullmatch(path.name)
        if match:
            found[int(match.group(2))] = path
    if not found:
        raise CheckpointError(
            f"{tag_dir} is not a DeepSpeed ZeRO checkpoint: it holds no zero_pp_rank_*_mp_rank_00_optim_states.pt "
            f"files (found: {sorted(p.name for p in tag_dir.iterdir())[:8]})", path=str(tag_dir),
        )
    missing = [r for r in range(max(found) + 1) if r not in found]
    if missing:
        raise CheckpointError(
            f"{tag_dir}: the optimizer file of rank {missing[0]} is missing (ranks found: {sorted(found)})",
            path=str(tag_dir),
        )
    return [found[r] for r in range(len(found))]


def _flat_groups(state: dict, path: Path) -> list[torch.Tensor]:
    """This rank's fp32 partition of each group (stage 3: of each sub-group), padding removed."""
    if "fp32_flat_groups" in state:
        return list(state["fp32_flat_groups"])
    flats = state.get("single_partition_of_fp32_groups")
    if not isinstance(flats, list):
        raise CheckpointError(f"{path} has no fp32 partitions: not a DeepSpeed ZeRO optimizer file", path=str(path))
    paddings = state.get("group_paddings") if "zero_stage" not in state else None  # BF16_Optimizer keeps its padding
    return [t[: t.numel() - paddings[i]] if paddings else t for i, t in enumerate(flats)]


@dataclass
class RankState:
    """One rank file's fp32 partitions and Adam states, per group (stage 3: joined over sub-groups)."""

    flats: list[torch.Tensor]
    moments: list[dict[str, torch.Tensor]]  # per group: exp_avg, exp_avg_sq (empty before the first step)
    steps: list[Optional[float]]  # per group: Adam's step, None before the first
    param_groups: list[dict]  # the base optimizer's hyper-parameters per group


def read_rank(checkpoint: DeepSpeedCheckpoint, rank: int) -> RankState:
    path = checkpoint.optim_files[rank]
    state = load_pickle(path).get("optimizer_state_dict")
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} has no optimizer_state_dict: not a DeepSpeed ZeRO optimizer file", path=str(path))
    flats = _flat_groups(state, path)
    base = state.get("base_optimizer_state") if checkpoint.stage < 3 else state.get("optimizer_state_dict")
    if not isinstance(base, dict) or "param_groups" not in base:
        raise CheckpointError(f"{path} has no base optimizer state", path=str(path))
    per_state = base.get("state") or {}
    param_groups = list(base["param_groups"])
    if checkpoint.stage == 3:  # sub-groups, each a flat tensor: joined per parameter group
        flats = [torch.cat([flats[i] for i in g["params"]]) for g in param_groups]
    moments, steps = [], []
    for g, group in enumerate(param_groups):
        states = [per_state.get(i) for i in group["params"]] if checkpoint.stage == 3 else [per_state.get(g)]
        if any(not s for s in states):
            moments.append({})
            steps.append(None)
            continue
        moments.append({key: torch.cat([s[key].reshape(-1) for s in states]) for key in MOMENTS})
        step_values = {float(s["step"]) for s in states}
        if len(step_values) != 1:
            raise CheckpointError(f"{path}: group {g}'s sub-groups hold different Adam steps {sorted(step_values)}")
        steps.append(step_values.pop())
    if len(flats) != len(checkpoint.groups):
        raise CheckpointMismatchError(
            f"{path} holds {len(flats)} optimizer groups, its model states file lists {len(checkpoint.groups)}"
        )
    return RankState(flats, moments, steps, param_groups)


def loss_scaler_state(checkpoint: DeepSpeedCheckpoint) -> dict:
    """DeepSpeed's loss scaler as zcore.step.precision's scalers hold it."""
    scaler = checkpoint.optimizer_state.get("loss_scaler")
    fields = vars(scaler) if isinstance(scaler, _LossScaler) else {}
    if "cur_scale" not in fields:
        return {}
    scale = float(fields["cur_scale"])
    if not checkpoint.optimizer_state.get("dynamic_loss_scale"):
        return {"scale": scale}
    return {
        "scale": scale,
        "iteration": int(fields["cur_iter"]),
        "last_overflow_iteration": int(fields["last_overflow_iter"]),
        "hysteresis_left": int(fields["cur_hysteresis"]),
    }
