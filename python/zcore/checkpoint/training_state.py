"""The training state beside the tensors, as JSON: optimizer hyper-parameters
and per-parameter scalars, loss scaler, scheduler, RNG, the user's
client_state. Loading never unpickles, so whatever cannot be JSON (or a
tensor stored beside it) is refused when saving, naming the key.
"""

from __future__ import annotations

import copy
import json
import math
import random
from typing import Any, Optional

import torch

from zcore.checkpoint.files import shown
from zcore.checkpoint.tensor_file import storable
from zcore.errors import CheckpointError
from zcore.memory.kernel_tensors import MASTER_DTYPES
from zcore.optim.compressed_adam import MOMENTUM_MASK

_TENSOR_REF = "__zcore_tensor__"


def _json_checked(value: Any, what: str) -> Any:
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"{what} cannot be saved without pickling ({exc}); zcore checkpoints hold JSON and "
            "tensors only: keep it to numbers, strings, lists, dicts and tensors"
        ) from None


# Optimizer.
def optimizer_kind(inner: torch.optim.Optimizer) -> str:
    """The update rule, so that a checkpoint moves between torch's Adam and
    zcore's CPU Adam (offload on or off) but not to another optimizer."""
    name = type(inner).__name__.removeprefix("CPU")
    if name == "Adam" and all(g.get("decoupled_weight_decay", False) for g in inner.param_groups):
        return "AdamW"
    return name


# Group keys a checkpoint leaves out: 1-bit Adam's momentum mask is the
# training script's to give at every start (DeepSpeed never loads it).
_NOT_SAVED = {"params", MOMENTUM_MASK}


def hyperparameters(inner: torch.optim.Optimizer) -> list[dict]:
    out = []
    for i, group in enumerate(inner.param_groups):
        values = {
            k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in group.items() if k not in _NOT_SAVED
        }
        out.append(_json_checked(values, f"optimizer parameter group {i}"))
    return out


# Hyper-parameters that must be finite and non-negative, and those in [0, 1).
_NON_NEGATIVE = {"lr", "eps", "weight_decay", "momentum", "dampening", "alpha", "rho", "lr_decay",
                 "initial_accumulator_value", "momentum_decay", "initial_lr"}
_FRACTIONS = {"betas"}


def check_hyperparameters(inner: torch.optim.Optimizer, saved: list[dict]) -> None:
    """Raises ValueError unless ``saved`` fits the optimizer's groups: one set
    per group, only keys the group has, each value of the current one's kind."""
    if len(saved) != len(inner.param_groups):
        raise ValueError(f"{len(saved)} sets for the optimizer's {len(inner.param_groups)} parameter groups")
    for i, (group, values) in enumerate(zip(inner.param_groups, saved)):
        for key, value in values.items():
            where = f"[{i}].{key}"
            if key == "params" or key not in group:
                known = sorted(k for k in group if k != "params")
                raise ValueError(f"{where}: the optimizer's groups have no key {key!r}; they have {known}")
            current = group[key]
            check_like(value, current.item() if isinstance(current, torch.Tensor) else current, where)
            numbers = value if isinstance(value, list) else [value]
            if key in _NON_NEGATIVE and any(isinstance(v, (int, float)) and v < 0 for v in numbers):
                raise ValueError(f"{where}: must not be negative, got {shown(value)}")
            if key in _FRACTIONS and not all(0 <= v < 1 for v in numbers):
                raise ValueError(f"{where}: must lie in [0, 1), got {shown(value)}")


def apply_hyperparameters(inner: torch.optim.Optimizer, saved: list[dict]) -> None:
    """As torch's Optimizer.load_state_dict: the saved values (checked by
    ``check_hyperparameters``) replace the current ones."""
    for group, values in zip(inner.param_groups, saved):
        for key, value in values.items():
            current = group[key]
            if isinstance(current, torch.Tensor):
                current.fill_(value)
            elif isinstance(current, tuple):
                group[key] = tuple(value)
            else:
                group[key] = value


def check_like(saved: Any, current: Any, where: str) -> None:
    """Raises ValueError unless JSON value ``saved`` has the structure of
    ``current`` (what the live object holds now): only keys it has, values
    of the same kind, lists as long, numbers finite or infinite but not NaN
    and integers within 2**53."""
    def fail(expected: str) -> None:
        raise ValueError(f"{where or 'value'}: expected {expected}, got {shown(saved)}")

    if isinstance(current, dict):
        if not isinstance(saved, dict):
            fail("an object")
        unknown = sorted(set(saved) - set(current))
        if unknown:
            fail(f"only keys {sorted(current)[:12]} (not {shown(unknown)})")
        for key, value in saved.items():
            check_like(value, current[key], f"{where}.{key}")
    elif isinstance(current, (list, tuple)):
        if not isinstance(saved, list) or len(saved) != len(current):
            fail(f"a list of {len(current)}")
        for i, (a, b) in enumerate(zip(saved, current)):
            check_like(a, b, f"{where}[{i}]")
    elif isinstance(current, bool) or current is None or isinstance(current, str):
        if type(saved) is not type(current):
            fail(type(current).__name__ if current is not None else "null")
    elif isinstance(current, (int, float)):
        if isinstance(saved, bool) or not isinstance(saved, (int, float)):
            fail("a number")
        if (isinstance(saved, float) and math.isnan(saved)) or (isinstance(saved, int) and abs(saved) > 2**53):
            fail("a number (not NaN, integers within 2**53)")
    else:
        fail(f"something zcore cannot restore into a {type(current).__name__}")


def check_scheduler(scheduler: Any, saved: dict) -> None:
    """Raises ValueError unless ``saved`` fits ``scheduler``'s state_dict;
    zcore's own schedules also compute their learning rates from it."""
    check_like(saved, scheduler.state_dict(), "")
    if hasattr(scheduler, "_apply"):  # zcore.optim.lr_schedules: a probe that leaves the optimizer alone
        if "last_batch_iteration" not in saved:
            raise ValueError("lacks last_batch_iteration, the schedule's position")
        probe = copy.copy(scheduler)
        probe.last_batch_iteration = saved["last_batch_iteration"]
        try:
            lrs = probe.get_lr()
        except (ValueError, ArithmeticError) as exc:
            raise ValueError(f"last_batch_iteration {shown(saved['last_batch_iteration'])}: {exc}") from None
        if not all(math.isfinite(lr) and lr >= 0 for lr in lrs):
            raise ValueError(f"last_batch_iteration {shown(saved['last_batch_iteration'])} gives learning rates {lrs}")


def split_state(state: dict, numel: int, what: str) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """One parameter piece's optimizer state: tensors shaped like the piece
    (stored as ranges) and scalars (JSON)."""
    ranged, scalars = {}, {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == numel:
            ranged[key] = value.reshape(-1)
        elif isinstance(value, torch.Tensor) and value.numel() == 1:
            scalars[key] = {"value": value.item(), "dtype": str(value.dtype).removeprefix("torch."),
                            "shape": list(value.shape)}
        elif value is None or isinstance(value, (bool, int, float)):
            scalars[key] = {"value": value}
        else:
            raise CheckpointError(
                f"optimizer state {key!r} of {what} is a {type(value).__name__} that is neither shaped "
                "like the parameter nor a scalar; zcore cannot slice it across ranks"
            )
    return ranged, scalars


def join_scalars(scalars: dict[str, Any]) -> dict[str, Any]:
    """From validated records (zcore.checkpoint.schema.ScalarState)."""
    out = {}
    for key, s in scalars.items():
        if s.dtype is not None:
            # Scalar tensors (Adam's step) stay on the CPU, as torch keeps them.
            out[key] = torch.tensor(s.value, dtype=getattr(torch, s.dtype)).reshape(s.shape)
        else:
            out[key] = s.value
    return out


_ADAM_STATE = {"step", "exp_avg", "exp_avg_sq"}


def checked_piece_state(
    state: dict[str, Any], live: Optional[dict], kind: str, group: dict, like: torch.Tensor
) -> dict[str, Any]:
    """A parameter piece's loaded optimizer state, its ranged floating-point
    states cast to the dtype the run keeps them in (the live ones', else
    ``like``'s: fp32 or bf16 moments, bf16.bf16_optimizer_states), so that a
    checkpoint loads whichever dtypes either run keeps. Raises ValueError
    unless it has the keys and kinds its optimizer keeps: those of the live
    state when the optimizer has stepped, else Adam's (the update rules
    zcore builds); one-element tensors as the live ones (Adam's step:
    float32, shape [], never negative)."""
    if live:
        expected: Optional[set] = set(live)
    elif kind in ("Adam", "AdamW"):
        expected = _ADAM_STATE | ({"max_exp_avg_sq"} if group.get("amsgrad") else set())
        live = {"step": torch.tensor(0.0)}
    else:
        expected, live = None, {}
    if expected is not None and set(state) != expected:
        raise ValueError(f"holds state keys {sorted(state)}; the optimizer keeps {sorted(expected)}")
    state = {key: _in_run_dtype(value, live.get(key), like) for key, value in state.items()}
    for key, value in state.items():
        ref = live.get(key)
        if isinstance(value, torch.Tensor) and value.dim() > 0 and not isinstance(ref, torch.Tensor):
            ref = like
        if isinstance(ref, torch.Tensor) and ref.dim() > 0:
            if not isinstance(value, torch.Tensor) or value.dtype != ref.dtype:
                raise ValueError(f"state {key!r} must be a {ref.dtype} range, not {shown(value)}")
        elif isinstance(ref, torch.Tensor):
            if not isinstance(value, torch.Tensor) or value.dtype != ref.dtype or value.shape != ref.shape:
                raise ValueError(f"state {key!r} must be a {ref.dtype} tensor of shape {list(ref.shape)}")
        elif ref is not None and type(value) is not type(ref):
            raise ValueError(f"state {key!r} must be a {type(ref).__name__}, not {shown(value)}")
        if key == "step" and (value < 0 if not isinstance(value, torch.Tensor) else bool((value < 0).any())):
            raise ValueError(f"state 'step' must not be negative, got {shown(value)}")
    return state


def _in_run_dtype(value: Any, ref: Any, like: torch.Tensor) -> Any:
    """A ranged fp32 or bf16 state in the one of the two its live
    counterpart (or ``like``) has; anything else as it is (and checked)."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.dtype not in MASTER_DTYPES:
        return value
    target = ref.dtype if isinstance(ref, torch.Tensor) and ref.dim() > 0 else like.dtype
    return value.to(target) if target in MASTER_DTYPES else value


def scheduler_state(scheduler: Any) -> Any:
    if scheduler is None or not hasattr(scheduler, "state_dict"):
        return None
    return _json_checked(scheduler.state_dict(), "the lr scheduler's state_dict")


# RNG of this rank.
def rng_state(device: torch.device) -> tuple[dict, dict[str, torch.Tensor]]:
    version, words, gauss = random.getstate()
    state: dict[str, Any] = {"python": [version, list(words), gauss]}
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [name, keys.tolist(), pos, has_gauss, cached]
    except ImportError:
        pass
    tensors = {"rng::torch": torch.get_rng_state()}
    if device.type == "cuda":
        tensors["rng::cuda"] = torch.cuda.get_rng_state(device)
    return state, tensors


def staged_rng(record: Any, tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, Any]:
    """The RNG states to set, from a validated record (schema.RngRecord) and
    the tensors read beside it, each tried on a scratch generator first:
    raises ValueError instead of failing (or crashing) when set."""
    py = record.python
    state: dict[str, Any] = {"python": (py.version, tuple(py.words), py.gauss)}
    try:
        random.Random().setstate(state["python"])
    except (ValueError, TypeError) as exc:
        raise ValueError(f"rng.python: {exc}") from None
    if record.numpy is not None:
        try:
            import numpy as np
        except ImportError:
            np = None
        if np is not None:
            n = record.numpy
            state["numpy"] = (n.name, np.array(n.keys, dtype=np.uint32), n.pos, n.has_gauss, n.cached)
            try:
                np.random.RandomState().set_state(state["numpy"])
            except (ValueError, TypeError) as exc:
                raise ValueError(f"rng.numpy: {exc}") from None
    # Copies: the tensors read from files view a larger buffer (page-aligned
    # for O_DIRECT), and torch's set_rng_state ignores a storage offset (segfault).
    torch_state = tensors.get("rng::torch")
    expected = torch.get_rng_state()
    if torch_state is None or torch_state.dtype != expected.dtype or torch_state.shape != expected.shape:
        raise ValueError(f"rng::torch must be a {expected.dtype} tensor of shape {list(expected.shape)}")
    state["torch"] = torch_state.clone()
    try:
        torch.Generator().set_state(state["torch"])
    except RuntimeError as exc:
        raise ValueError(f"rng::torch: {str(exc)[:200]}") from None
    if device.type == "cuda" and "rng::cuda" in tensors:
        cuda = tensors["rng::cuda"]
        expected = torch.cuda.get_rng_state(device)
        if cuda.dtype != expected.dtype or cuda.shape != expected.shape:
            raise ValueError(f"rng::cuda must be a {expected.dtype} tensor of shape {list(expected.shape)}")
        state["cuda"] = cuda.clone()
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Sets what ``staged_rng`` checked; cannot fail."""
    random.setstate(state["python"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


# The user's client_state: JSON, with tensors stored beside it.
def encode_client_state(value: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """(JSON with references to tensors, the tensors by reference) of a
    save's ``client_state``; a CheckpointError naming the first key whose
    value a checkpoint cannot hold."""
    tensors: dict[str, torch.Tensor] = {}

    def encode(v: Any, path: str) -> Any:
        if isinstance(v, torch.Tensor):
            storable(v.dtype, f"client_state{path}")
            key = f"client::{len(tensors)}"
            # A copy: an asynchronous save writes it after the caller goes on.
            tensors[key] = v.detach().to("cpu", copy=True).contiguous()
            return {_TENSOR_REF: key}
        if isinstance(v, dict):
            if not all(isinstance(k, str) for k in v):
                raise CheckpointError(f"client_state{path} has a key that is not a string; use string keys")
            return {k: encode(x, f"{path}[{k!r}]") for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [encode(x, f"{path}[{i}]") for i, x in enumerate(v)]
        return _json_checked(v, f"client_state{path}")

    return encode(value, ""), tensors


def decode_client_state(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Raises ValueError for a reference to a tensor that was not stored."""
    if isinstance(value, dict):
        if set(value) == {_TENSOR_REF}:
            key = value[_TENSOR_REF]
            if not isinstance(key, str) or key not in tensors:
                raise ValueError(f"client_state refers to tensor {shown(key)}, which rank 0's state file lacks")
            return tensors[key]
        return {k: decode_client_state(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_client_state(v, tensors) for v in value]
    return value
