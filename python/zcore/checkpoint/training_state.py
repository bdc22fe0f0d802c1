"""The training state beside the tensors, as JSON: optimizer hyper-parameters
and per-parameter scalars, loss scaler, scheduler, RNG, the user's
client_state. Loading never unpickles, so whatever cannot be JSON (or a
tensor stored beside it) is refused when saving, naming the key.
"""

from __future__ import annotations

import json
import random
from typing import Any

import torch

from zcore.errors import CheckpointError

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


def hyperparameters(inner: torch.optim.Optimizer) -> list[dict]:
    out = []
    for i, group in enumerate(inner.param_groups):
        values = {k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in group.items() if k != "params"}
        out.append(_json_checked(values, f"optimizer parameter group {i}"))
    return out


def apply_hyperparameters(inner: torch.optim.Optimizer, saved: list[dict]) -> None:
    """As torch's Optimizer.load_state_dict: the saved values replace the current ones."""
    for group, values in zip(inner.param_groups, saved):
        for key, value in values.items():
            current = group.get(key)
            if isinstance(current, torch.Tensor):
                current.fill_(value)
            elif isinstance(current, tuple):
                group[key] = tuple(value)
            else:
                group[key] = value


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


def join_scalars(scalars: dict[str, dict]) -> dict[str, Any]:
    out = {}
    for key, s in scalars.items():
        if "dtype" in s:
            # Scalar tensors (Adam's step) stay on the CPU, as torch keeps them.
            out[key] = torch.tensor(s["value"], dtype=getattr(torch, s["dtype"])).reshape(s["shape"])
        else:
            out[key] = s["value"]
    return out


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


def set_rng_state(state: dict, tensors: dict[str, torch.Tensor], device: torch.device) -> None:
    version, words, gauss = state["python"]
    random.setstate((version, tuple(words), gauss))
    if "numpy" in state:
        try:
            import numpy as np

            name, keys, pos, has_gauss, cached = state["numpy"]
            np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
        except ImportError:
            pass
    # Copies: the tensors read from files view a larger buffer (page-aligned
    # for O_DIRECT), and torch's set_rng_state ignores a storage offset (segfault).
    torch.set_rng_state(tensors["rng::torch"].clone())
    if device.type == "cuda" and "rng::cuda" in tensors:
        torch.cuda.set_rng_state(tensors["rng::cuda"].clone(), device)


# The user's client_state: JSON, with tensors stored beside it.
def encode_client_state(value: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    tensors: dict[str, torch.Tensor] = {}

    def encode(v: Any, path: str) -> Any:
        if isinstance(v, torch.Tensor):
            key = f"client::{len(tensors)}"
            tensors[key] = v.detach().cpu().contiguous()
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
    if isinstance(value, dict):
        if set(value) == {_TENSOR_REF}:
            return tensors[value[_TENSOR_REF]]
        return {k: decode_client_state(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_client_state(v, tensors) for v in value]
    return value
